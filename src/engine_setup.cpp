// Engine: finalize(). The tiers that will hold every unit, and the initial values.
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <new>

#include "base/agree.hpp"
#include "base/check.hpp"
#include "src/config/internal.hpp"
#include "src/engine_impl.hpp"
#include "src/tiers/memory_param_tier.hpp"
#include "src/tiers/memory_state_tier.hpp"
#include "src/tiers/nvme_param_tier.hpp"
#include "src/tiers/nvme_state_tier.hpp"
#include "src/tiers/staged_param_tier.hpp"
#include "src/tiers/staged_state_tier.hpp"

namespace zeroshard {

// The stage logic's own buffers, then one parameter tier and one state tier, chosen here and
// nowhere else.
void Engine::Impl::make_tiers() {
  const int st = cfg.stage;
  const Tier topt = cfg.offload_optimizer.tier;
  const Tier tpar = st == 3 ? cfg.offload_param.tier : Tier::device;
  TierContext& c = tier_ctx;
  c.cfg = &cfg;
  c.units = &shapes;
  c.rank = rank;
  c.shard_rank = topo.shard_rank;
  c.pdt = pdt;
  c.pbytes = pbytes;
  c.num_states = num_states();
  c.ledger = &res.ledger;
  c.plan_only = res.ledger.counting_only();
  c.comm = comm.get();
  // Device-tier memory comes from the device's backend; pinned host-tier memory from CUDA when
  // the device is a GPU (so copies are DMA), else from the heap, mlock'ed.
  c.buffer = [this](Tier t, MemKind kind, const char* name, size_t bytes, bool pin) {
    if (t == Tier::device)
      return Buffer(&res.ledger, t, kind, name, bytes, res.dev->device_memory());
    if (pin && res.dev->pinned_memory())
      return Buffer(&res.ledger, t, kind, name, bytes, res.dev->pinned_memory());
    return Buffer(&res.ledger, t, kind, name, bytes, pin);
  };
  c.finish_reduction = [this](int u) { finish_reduction(u); };
  plan_muon();  // sets c.direction where a group is muon

  reductions.next = int(units.size()) - 1;
  largest = 0;
  for (size_t i = 0; i < units.size(); ++i) {
    const UnitLayout& L = layout(int(i));
    largest = std::max(largest, L.padded_numel);
    if (st < 2)
      units[i].grad_buf =
          c.buffer(Tier::device, MemKind::grad, "grad", size_t(L.padded_numel) * pbytes, false);
  }
  // Gradient staging: one slot per unit that may be out at once, sized by the grad_buffers
  // largest units (any grad_buffers units fit, each in the smallest free slot that holds it),
  // so stage 2 starts with no more gradient memory than stage 1, even when one unit is most of
  // the model (take_grad_staging() may grow a slot for a trainer that keeps units out).
  if (st >= 2) {
    std::vector<int64_t> sizes;
    for (size_t i = 0; i < units.size(); ++i) sizes.push_back(layout(int(i)).padded_numel);
    std::sort(sizes.begin(), sizes.end(), std::greater<>());
    sizes.resize(std::min(sizes.size(), size_t(cfg.grad_buffers)));
    for (int64_t n : sizes)
      res.grad_staging.fill(1, [&] {
        return c.buffer(Tier::device, MemKind::buffer, "grad_staging", size_t(n) * pbytes, false);
      });
  }
  if (st == 3)
    res.gather.fill(cfg.max_live_units, [&] {
      return c.buffer(Tier::device, MemKind::buffer, "gather", size_t(largest) * pbytes, false);
    });

  if (topt == Tier::nvme || tpar == Tier::nvme)
    res.swap = std::make_unique<offload::SwapSpace>(rank);
  if (tpar == Tier::nvme) {
    params = std::make_unique<offload::NvmeParamTier>(c, res.arena, *res.swap, topt != Tier::nvme);
  } else {
    params = std::make_unique<MemoryParamTier>(c, tpar, *res.dev, *res.host);
  }
  // A GPU (or the asynchronous CPU device playing one) with stage 3's shards off it: each
  // gather copies its shard up first.
  const bool on_gpu = res.dev->streams();
  if (on_gpu && tpar != Tier::device)
    params = std::make_unique<StagedParamTier>(c, std::move(params), *res.dev);
  // An f32 model's master weights are its parameters when both live in the same memory (the
  // parameter tier says whether it can share them).
  std::vector<std::optional<float*>> alias(units.size());
  for (size_t i = 0; i < units.size() && topt == tpar && topt != Tier::nvme; ++i)
    alias[i] = params->share_as_master(int(i));
  // Under a GPU's staged tier the new shards go straight to its upload buffers.
  using S = Speculative;
  const S spec = !speculation_off().empty()                               ? S::off
                 : on_gpu && topt != Tier::device && tpar == Tier::device ? S::caller_out
                                                                          : S::own_out;
  if (topt == Tier::nvme) {
    state = std::make_unique<offload::NvmeStateTier>(c, res.arena, *res.swap,
                                                     params->takes_writes(), spec);
  } else {
    Compute& work = topt == Tier::device ? *res.dev : *res.host;
    state = std::make_unique<MemoryStateTier>(c, topt, work, res.arena, alias, params->previews(),
                                              spec);
  }
  // A GPU with the optimizer on the CPU: gradients come down, parameters go up (unless their
  // shards live off the GPU too: the update then writes them where they are).
  if (on_gpu && topt != Tier::device)
    state = std::make_unique<StagedStateTier>(c, std::move(state), *res.dev, tpar == Tier::device);
  if (c.plan_only) return;  // a plan: no memory to register, no I/O to start
  if (res.swap) res.swap->start(cfg.aio);
  std::vector<std::pair<void*, size_t>> regions = state->dma_regions();
  for (auto r : params->dma_regions()) regions.push_back(r);
  for (auto [p, n] : regions)
    if (auto h = res.dev->register_host(p, n)) dma.push_back(std::move(h));
}

// Initial values go through f32 once; the low-precision copy is rounded from the master, so every
// stage starts from bitwise the same state.
void Engine::Impl::load_initial_values() {
  if (res.ledger.counting_only()) return;  // a plan holds no values
  std::vector<float> whole;
  for (size_t i = 0; i < units.size(); ++i) {
    Unit& u = units[i];
    const UnitLayout& L = layout(int(i));
    bool any = false;
    for (const Param& p : u.init_params) any |= p.init.data != nullptr;
    if (any) {
      whole.assign(size_t(L.padded_numel), 0.0f);
      for (size_t j = 0; j < u.init_params.size(); ++j) {
        const TensorView& v = u.init_params[j].init;
        if (v.data)
          cpu::convert(res.arena.isa(), v.data, v.dtype, whole.data() + L.params[j].offset,
                       DType::f32, v.numel);
      }
    }
    state->load_initial(int(i), any ? whole.data() : nullptr);
    params->load_initial(int(i), any ? whole.data() : nullptr);
    u.init_params.clear();
    u.init_params.shrink_to_fit();
  }
  state->finish_load();
  params->finish_load();
}

std::string Engine::Impl::speculation_off() const {
  return config_detail::speculation_off(cfg, bool(tier_ctx.direction), res.dev->streams());
}

void Engine::Impl::drop_tiers() noexcept {
  if (res.swap) res.swap->stop();
  dma.clear();
  state.reset();
  params.reset();
  res.swap.reset();  // removes the swap directory
}

// Which host every rank runs on (a hash of its host name, in a sum of one slot per rank), so
// that StepResult can count the bytes each ring sends to another host.
void Engine::Impl::find_hosts() {
  char name[256] = {};
  ::gethostname(name, sizeof name - 1);
  uint64_t h = 1469598103934665603ull;  // FNV-1a, cut to 52 bits: exact in a double
  for (const char* c = name; *c; ++c) h = (h ^ uint8_t(*c)) * 1099511628211ull;
  std::vector<double> host(size_t(world), 0.0);
  host[size_t(rank)] = double(h & ((uint64_t(1) << 52) - 1));
  comm->all_reduce(host.data(), world, ReduceOp::sum, "host names")->wait();
  const double mine = host[size_t(rank)];
  const int base = topo.replica * topo.shard_world;
  topo.shard_next_remote = host[size_t(base + (topo.shard_rank + 1) % topo.shard_world)] != mine;
  topo.shard_remote.assign(size_t(topo.shard_world), false);
  for (int q = 0; q < topo.shard_world; ++q)
    topo.shard_remote[size_t(q)] = host[size_t(base + q)] != mine;
  topo.replica_next_remote =
      host[size_t((topo.replica + 1) % topo.replicas * topo.shard_world + topo.shard_rank)] != mine;
}

void Engine::finalize() {
  Impl& m = *impl_;
  if (m.finalized) ZS_THROW(invalid_argument, "rank " << m.rank << ": finalize() called twice");
  if (m.units.empty())
    ZS_THROW(invalid_argument, "rank " << m.rank << ": finalize() with no units registered");
  m.check_same_model();
  m.find_hosts();
  if (m.cfg.offload_optimizer.tier == Tier::nvme ||
      (m.cfg.stage == 3 && m.cfg.offload_param.tier == Tier::nvme)) {
    // Swap files can fail on one rank only (a full or read-only path): every rank must then
    // fail here, naming the rank and path, instead of hanging in its first collective.
    std::optional<Error> mine;
    try {
      m.make_tiers();
      m.load_initial_values();
    } catch (const Error& e) {
      mine = e;
    } catch (const std::bad_alloc&) {
      mine = Error(ErrorCode::no_space,
                   "rank " + std::to_string(m.rank) + ": finalize(): out of host memory");
    } catch (const std::exception& e) {
      mine = Error(ErrorCode::internal,
                   "rank " + std::to_string(m.rank) + ": finalize(): " + e.what());
    }
    if (std::optional<Error> e = agree(*m.comm, mine, "finalize()")) {
      m.drop_tiers();  // a failed finalize() leaves nothing behind
      throw *e;
    }
  } else {
    m.make_tiers();
    m.load_initial_values();
  }
  // No hand_to_trainer(): loading the initial values waited for their copies (mutate_waits.py).
  m.finalized = true;
  m.reserve_snapshot(*this);
  if (config_detail::speculation_said(m.cfg, m.res.dev->streams()) && m.rank == 0 &&
      !m.res.ledger.counting_only()) {
    const std::string off = m.speculation_off();
    const char* how = speculative_step_name(m.cfg.speculative_step);
    if (!off.empty())
      std::fprintf(stderr, "zeroshard: speculative_step (%s) is off: %s\n", how, off.c_str());
    else if (m.cfg.speculative_step == SpeculativeStep::automatic)
      std::fprintf(stderr,
                   "zeroshard: speculative_step (auto) is on: the optimizer state is on the nvme "
                   "tier and backward runs on the device, so each unit's update runs during "
                   "backward\n");
  }
  m.clock.interval_start =
      std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

}  // namespace zeroshard
