// Engine: Muon's direction. Muon orthogonalises each weight matrix's averaged gradient whole,
// while the state is sharded at arbitrary element offsets. Per unit, just before its update
// (TierContext::direction):
//   1. each rank averages its extent of every Muon matrix: m' = μ·m + (1 − μ)·g, the direction
//      (1 − μ)·g + μ·m' with Nesterov, else m' — from the same gradient and momentum the update
//      then reads, and with the same operations (the update stores m');
//   2. in rounds (src/muon_exchange.hpp), each rank of the shard group gathers one matrix it
//      owns from the ranks that hold its pieces (all_to_all, f32), orthogonalises it
//      (kernels/cpu/newton_schulz.hpp), scales it by its shape's learning-rate factor, and
//      sends each holder its piece of the result back into that holder's extent.
// So a rank holds one matrix whole at a time, and only the pieces whose holder is not their
// matrix's owner cross between ranks. Stage 0 holds whole units: nothing is gathered and every
// rank receives every result. One rank alone averages and orthogonalises in place. Where the
// state is, the work is: on the host by the CPU's kernels, or in a GPU's memory by its kernels
// and cuBLAS, exchanged over device buffers (Compute's Muon kernels). docs/muon.md has the
// memory and communication this costs.
#include <algorithm>
#include <chrono>
#include <climits>
#include <cmath>

#include "base/check.hpp"
#include "kernels/cpu/newton_schulz.hpp"
#include "src/compute/device_communicator.hpp"
#include "src/engine_impl.hpp"
#include "src/muon_exchange.hpp"

namespace zeroshard {

namespace {

// This rank's part of a unit's rounds: its pieces, with offsets in its extent (which starts at
// `start` in the unit) or in the matrix it orthogonalises that round.
std::vector<MuonPlan::Round> my_rounds(const std::vector<MuonRound>& rounds,
                                       const std::vector<MuonMatrix>& mats, int ranks, int me,
                                       int64_t start) {
  std::vector<MuonPlan::Round> out;
  const auto none = [&] {
    return Pieces{std::vector<int64_t>(size_t(ranks), 0), std::vector<int64_t>(size_t(ranks), 0)};
  };
  for (const MuonRound& r : rounds) {
    MuonPlan::Round m;
    m.matrix = r.matrix[size_t(me)];
    m.gather_send = m.gather_recv = m.scatter_send = m.scatter_recv = none();
    for (const MuonTransfer& t : r.gather) {  // extent → the owner's matrix
      const int64_t at = t.offset - mats[size_t(r.matrix[size_t(t.to)])].offset;
      if (t.from == me) {
        m.gather_send.counts[size_t(t.to)] = t.count;
        m.gather_send.offsets[size_t(t.to)] = t.offset - start;
      }
      if (t.to == me) {
        m.gather_recv.counts[size_t(t.from)] = t.count;
        m.gather_recv.offsets[size_t(t.from)] = at;
      }
    }
    for (const MuonTransfer& t : r.scatter) {  // the owner's matrix → extent
      const int64_t at = t.offset - mats[size_t(r.matrix[size_t(t.from)])].offset;
      if (t.from == me) {
        m.scatter_send.counts[size_t(t.to)] = t.count;
        m.scatter_send.offsets[size_t(t.to)] = at;
      }
      if (t.to == me) {
        m.scatter_recv.counts[size_t(t.from)] = t.count;
        m.scatter_recv.offsets[size_t(t.from)] = t.offset - start;
      }
    }
    out.push_back(std::move(m));
  }
  return out;
}

}  // namespace

void Engine::Impl::plan_muon() {
  const bool any = std::any_of(groups.begin(), groups.end(), [](const OptimizerOptions& g) {
    return g.kind == OptimizerKind::muon;
  });
  muon.units.assign(units.size(), {});
  muon.rounds.assign(units.size(), {});
  if (!any) return;
  // Owners: muon_matrices(), the planner's too.
  std::vector<double> load(size_t(topo.shard_world), 0.0);
  const bool alone = topo.shard_world == 1;
  int64_t mine = 0, biggest = 0, scratch = 0, any_matrix = 0;
  for (size_t u = 0; u < units.size(); ++u) {
    const UnitLayout& L = layout(int(u));
    for (const ParamSlot& p : L.params)
      if (groups[size_t(p.group)].kind == OptimizerKind::muon && p.shape.size() < 2)
        ZS_THROW(invalid_argument,
                 "rank " << rank << ": finalize(): parameter '" << p.name << "' of unit '" << L.name
                         << "' is in Muon group " << p.group << " but has " << p.shape.size()
                         << " dimension(s): Muon orthogonalises matrices; put vectors (biases, "
                            "norms) in an adam or adamw group");
    std::vector<MuonMatrix>& mats = muon.units[u] = muon_matrices(L, groups, load);
    for (const MuonMatrix& m : mats) {
      any_matrix = std::max(any_matrix, m.numel());
      if (alone || m.owner == topo.shard_rank) {
        scratch = std::max(scratch, cpu::newton_schulz_scratch(m.rows, m.cols));
        biggest = std::max(biggest, m.numel());
      }
    }
    if (mats.empty()) continue;
    mine = std::max(mine, cfg.stage == 0 ? L.padded_numel : L.shard_numel);
    if (alone) continue;
    const int64_t shard = cfg.stage == 0 ? 0 : L.shard_numel;
    muon.rounds[u] = my_rounds(muon_rounds(mats, topo.shard_world, shard), mats, topo.shard_world,
                               topo.shard_rank, int64_t(topo.shard_rank) * shard);
  }
  if (mine == 0) return;
  // MPI counts elements in int: a piece beyond it could fail on some ranks only, leaving the
  // others waiting; refused here on every rank alike. NCCL counts in size_t (a plan of a GPU
  // engine stands for one on NCCL).
  const auto* dc = as_device_communicator(topo.shard_comm.get());
  const bool nccl = tier_ctx.plan_only ? cfg.device == Device::cuda : dc && dc->device() >= 0;
  if (!alone && !nccl && std::max(mine, any_matrix) > INT_MAX)
    ZS_THROW(invalid_argument,
             "rank " << rank << ": finalize(): Muon's exchange moves pieces of a unit's "
                     << (cfg.stage == 0 ? "whole" : "shard") << " of up to "
                     << std::max(mine, any_matrix)
                     << " elements, beyond the int counts of an MPI collective: register smaller "
                        "units (or a matrix below 2^31 elements)");
  muon.on_device = res.dev->streams() && cfg.offload_optimizer.tier == Tier::device;
  const Tier t = muon.on_device ? Tier::device : Tier::host;
  muon.mine = tier_ctx.buffer(t, MemKind::buffer, "muon_direction", size_t(mine) * 4, false);
  if (!alone && biggest > 0)
    muon.exchange =
        tier_ctx.buffer(t, MemKind::buffer, "muon_exchange", size_t(biggest) * 4, false);
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
  const std::vector<MuonMatrix>& mats = muon.units[size_t(u)];
  if (mats.empty()) return nullptr;
  ZS_CHECK(muon.hyper != nullptr);
  const UnitLayout& L = layout(u);
  const Unit& unit = units[size_t(u)];
  Compute& k = muon.on_device ? *res.dev : *res.host;
  const int64_t n = a.n;
  const int64_t start = cfg.stage == 0 ? 0 : int64_t(topo.shard_rank) * L.shard_numel;
  float* mine = muon.mine.as<float>();
  k.fill(mine, 0, size_t(n) * 4);
  // 1. This rank's extent of each matrix's direction; a held matrix (no gradient this step on
  //    any rank) keeps a zero direction, which its held update never reads.
  for (const MuonMatrix& m : mats) {
    if (unit.held[size_t(m.param)] || !a.grad) continue;  // no grad: this rank's update failed
    const int64_t lo = std::max<int64_t>(m.offset - start, 0);
    const int64_t hi = std::min<int64_t>(m.offset + m.rows * m.cols - start, n);
    if (lo >= hi) continue;
    k.muon_average(a, (*muon.hyper)[size_t(L.params[size_t(m.param)].group)], lo, hi, mine + lo);
  }
  const bool alone = topo.shard_world == 1;
  // The iteration on matrix m, whole at `x`, scaled by its shape's factor.
  const auto orthogonalise = [&](const MuonMatrix& m, float* x) {
    if (unit.held[size_t(m.param)]) return;
    const OptimizerOptions& o = groups[size_t(L.params[size_t(m.param)].group)];
    const auto t0 = std::chrono::steady_clock::now();
    k.newton_schulz(x, m.rows, m.cols, {o.ns_steps, o.eps, o.ns_bf16, lr_factor(o, m.rows, m.cols)},
                    muon.scratch.as<float>());
    // On a GPU the iteration is queued: its time is in the update's, not here.
    if (!muon.on_device)
      muon.ns_s += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  };
  if (alone) {
    for (const MuonMatrix& m : mats) orthogonalise(m, mine + m.offset);
    return mine;
  }
  // 2. Round by round, one matrix whole on each rank: gathered, orthogonalised, sent back.
  float* whole = muon.exchange.as<float>();
  const std::vector<MuonPlan::Round>& rounds = muon.rounds[size_t(u)];
  for (size_t r = 0; r < rounds.size(); ++r) {
    const MuonPlan::Round& round = rounds[r];
    const MuonMatrix* m = round.matrix >= 0 ? &mats[size_t(round.matrix)] : nullptr;
    const std::string what = "unit '" + L.name + "' (Muon round " + std::to_string(r + 1) + " of " +
                             std::to_string(rounds.size()) + ", ";
    if (cfg.stage > 0)
      exchange_pieces(*topo.shard_comm, muon.on_device, mine, round.gather_send, whole,
                      round.gather_recv, what + "directions)", true);
    else if (m)  // the whole unit is here
      k.copy(whole, mine + m->offset, size_t(m->rows * m->cols) * 4);
    if (m) orthogonalise(*m, whole);
    exchange_pieces(*topo.shard_comm, muon.on_device, whole, round.scatter_send, mine,
                    round.scatter_recv, what + "updates)", true);
    count_sent(round.gather_send, 4);
    count_sent(round.scatter_send, 4);
  }
  return mine;
}

}  // namespace zeroshard
