// Engine: Muon's direction. Muon orthogonalises each weight matrix's averaged gradient whole,
// while the state is sharded at arbitrary element offsets. Per unit, just before its update
// (TierContext::direction):
//   1. each rank averages its extent of every Muon matrix: m' = μ·m + (1 − μ)·g, the direction
//      (1 − μ)·g + μ·m' with Nesterov, else m' — from the same gradient and momentum the update
//      then reads, and with the same operations (the update stores m');
//   2. the unit's directions are all-gathered in f32 over the shard group;
//   3. each matrix is orthogonalised (kernels/cpu/newton_schulz.hpp) by the one rank that owns
//      it, and scaled by its shape's learning-rate factor;
//   4. every rank zeroes what it does not own and a reduce-scatter (a sum with one non-zero
//      term per element, so exact) hands each rank its extent of the result.
// Stage 0 holds whole units: step 2 is skipped and step 4 is an all-reduce. One rank alone does
// steps 1 and 3 only. Where the state is, the work is: on the host by the CPU's kernels, or in
// a GPU's memory by its kernels and cuBLAS, exchanged over device buffers (Compute's Muon
// kernels). docs/muon.md has the memory and communication this costs.
#include <algorithm>
#include <chrono>
#include <cmath>

#include "base/check.hpp"
#include "kernels/cpu/newton_schulz.hpp"
#include "src/engine_impl.hpp"

namespace zeroshard {

void Engine::Impl::plan_muon() {
  const bool any = std::any_of(groups.begin(), groups.end(), [](const OptimizerOptions& g) {
    return g.kind == OptimizerKind::muon;
  });
  muon.units.assign(units.size(), {});
  if (!any) return;
  // Owners: cpu::assign_owners(), the planner's too.
  std::vector<double> load(size_t(topo.shard_world), 0.0);
  int64_t mine = 0, whole = 0, scratch = 0;
  for (size_t u = 0; u < units.size(); ++u) {
    const UnitLayout& L = layout(int(u));
    std::vector<double> cost;
    for (size_t j = 0; j < L.params.size(); ++j) {
      const ParamSlot& p = L.params[j];
      if (groups[size_t(p.group)].kind != OptimizerKind::muon) continue;
      if (p.shape.size() < 2)
        ZS_THROW(invalid_argument,
                 "rank " << rank << ": finalize(): parameter '" << p.name << "' of unit '" << L.name
                         << "' is in Muon group " << p.group << " but has " << p.shape.size()
                         << " dimension(s): Muon orthogonalises matrices; put vectors (biases, "
                            "norms) in an adam or adamw group");
      if (p.numel == 0) continue;
      MuonPlan::Matrix m;
      m.param = int(j);
      m.offset = p.offset;
      m.rows = p.shape[0];
      m.cols = p.numel / p.shape[0];
      cost.push_back(cpu::newton_schulz_cost(m.rows, m.cols, groups[size_t(p.group)].ns_steps));
      muon.units[u].push_back(m);
    }
    const std::vector<int> owner = cpu::assign_owners(cost, load);
    for (size_t i = 0; i < owner.size(); ++i) {
      MuonPlan::Matrix& m = muon.units[u][i];
      m.owner = owner[i];
      if (topo.shard_world == 1 || m.owner == topo.shard_rank)
        scratch = std::max(scratch, cpu::newton_schulz_scratch(m.rows, m.cols));
    }
    // In offset order, as muon_direction() zeroes around the matrices it owns.
    std::sort(
        muon.units[u].begin(), muon.units[u].end(),
        [](const MuonPlan::Matrix& a, const MuonPlan::Matrix& b) { return a.offset < b.offset; });
    if (cost.empty()) continue;
    mine = std::max(mine, cfg.stage == 0 ? L.padded_numel : L.shard_numel);
    if (cfg.stage > 0 && topo.shard_world > 1) whole = std::max(whole, L.padded_numel);
  }
  if (mine == 0) return;
  muon.on_device = res.dev->streams() && cfg.offload_optimizer.tier == Tier::device;
  const Tier t = muon.on_device ? Tier::device : Tier::host;
  muon.mine = tier_ctx.buffer(t, MemKind::buffer, "muon_direction", size_t(mine) * 4, false);
  if (whole > 0)
    muon.whole = tier_ctx.buffer(t, MemKind::buffer, "muon_exchange", size_t(whole) * 4, false);
  if (scratch > 0)
    muon.scratch = tier_ctx.buffer(t, MemKind::buffer, "muon_scratch", size_t(scratch) * 4, false);
  tier_ctx.direction = [this](int u, const cpu::UpdateArgs& a) { return muon_direction(u, a); };
}

namespace {

// How Muon scales a matrix's step by its shape (OptimizerOptions::match_rms_adamw).
float lr_factor(const OptimizerOptions& o, int64_t rows, int64_t cols) {
  const double a = double(rows), b = double(cols);
  return float(o.match_rms_adamw ? 0.2 * std::sqrt(std::max(a, b))
                                 : std::sqrt(std::max(1.0, a / b)));
}

}  // namespace

const float* Engine::Impl::muon_direction(int u, const cpu::UpdateArgs& a) {
  const std::vector<MuonPlan::Matrix>& mats = muon.units[size_t(u)];
  if (mats.empty()) return nullptr;
  ZS_CHECK(muon.hyper != nullptr);
  const UnitLayout& L = layout(u);
  const Unit& unit = units[size_t(u)];
  Compute& k = muon.on_device ? *res.dev : *res.host;
  const auto exchange = [&](CollectiveOp op, const float* send, float* recv, int64_t count,
                            const std::string& what) {
    if (muon.on_device)
      device_collective(*topo.shard_comm, op, send, recv, count, what, true);
    else
      host_collective(*topo.shard_comm, op, send, recv, count, what, true);
  };
  const int64_t n = a.n;
  const int64_t start = cfg.stage == 0 ? 0 : int64_t(topo.shard_rank) * L.shard_numel;
  float* mine = muon.mine.as<float>();
  k.fill(mine, 0, size_t(n) * 4);
  // 1. This rank's extent of each matrix's direction; a held matrix (no gradient this step on
  //    any rank) keeps a zero direction, which its held update never reads.
  for (const MuonPlan::Matrix& m : mats) {
    if (unit.held[size_t(m.param)] || !a.grad) continue;  // no grad: this rank's update failed
    const int64_t lo = std::max<int64_t>(m.offset - start, 0);
    const int64_t hi = std::min<int64_t>(m.offset + m.rows * m.cols - start, n);
    if (lo >= hi) continue;
    k.muon_average(a, (*muon.hyper)[size_t(L.params[size_t(m.param)].group)], lo, hi, mine + lo);
  }
  const bool alone = topo.shard_world == 1;
  const bool sharded = cfg.stage > 0 && !alone;
  // 2. The whole unit's directions on every rank of the group.
  float* whole = mine;
  if (sharded) {
    whole = muon.whole.as<float>();
    exchange(CollectiveOp::all_gather, mine, whole, L.shard_numel,
             "unit '" + L.name + "' (Muon directions)");
    count_sent(false, int64_t(topo.shard_world - 1) * L.shard_numel * 4);
  }
  // 3. This rank's matrices orthogonalised and scaled; 4. the rest zeroed, then summed.
  int64_t kept = 0;  // whole[kept, m.offset) is not this rank's
  for (const MuonPlan::Matrix& m : mats) {
    if (alone || m.owner == topo.shard_rank) {
      if (!alone) k.fill(whole + kept, 0, size_t(m.offset - kept) * 4);
      kept = m.offset + m.rows * m.cols;
      if (unit.held[size_t(m.param)]) continue;
      const OptimizerOptions& o = groups[size_t(L.params[size_t(m.param)].group)];
      const auto t0 = std::chrono::steady_clock::now();
      k.newton_schulz(whole + m.offset, m.rows, m.cols,
                      {o.ns_steps, o.eps, o.ns_bf16, lr_factor(o, m.rows, m.cols)},
                      muon.scratch.as<float>());
      // On a GPU the iteration is queued: its time is in the update's, not here.
      if (!muon.on_device)
        muon.ns_s += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    }
  }
  if (alone) return mine;
  const int64_t total = sharded ? L.padded_numel : n;
  k.fill(whole + kept, 0, size_t(total - kept) * 4);
  exchange(sharded ? CollectiveOp::reduce_scatter : CollectiveOp::all_reduce_sum,
           sharded ? whole : mine, mine, sharded ? L.shard_numel : n,
           "unit '" + L.name + "' (Muon updates)");
  // A ring's reduce-scatter sends (n − 1)/n of the data; an all-reduce twice that.
  count_sent(false, (sharded ? 1 : 2) * int64_t(topo.shard_world - 1) * L.shard_numel * 4);
  return mine;
}

}  // namespace zeroshard
