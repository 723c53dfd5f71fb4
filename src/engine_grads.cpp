// Engine: gradients. The trainer's gradient buffers, the reduce-scatter of each unit as its
// gradients are ready (overlapping the rest of backward), and the hand-over of the reduced shard
// to the state tier.
//
// The order of the reductions is the engine's, not the trainer's: in every micro-step, from the
// last registered unit to the first (the order of a backward pass), on every rank. A unit handed
// over early waits, keeping its gradient buffer, until the units before it in that order are
// handed over too. So ranks whose control flow differs (a branch or a head used on some ranks
// only, hooks that fire in another order) still reduce the same unit in the same collective;
// with their order the trainer chooses only how much of the reduction overlaps its backward.
#include "base/check.hpp"
#include "src/engine_impl.hpp"

namespace zeroshard {

namespace {
std::string device_string(Device d, int index) {
  return d == Device::cpu ? std::string("the CPU") : "GPU " + std::to_string(index);
}
}  // namespace

void* Engine::Impl::grad_buffer(int id) const {
  const Unit& u = units[size_t(id)];
  return cfg.stage < 2 ? u.grad_buf.data() : res.grad_staging.data(u.grad_slot);
}

// Reductions complete in the order they were issued, the same on every rank. Completing one is a
// local wait, except in stage 0, where it is an all-gather of the reduced shards: there every
// unit of a micro-step completes at one point of the sequence, when the last of them is issued
// (issue_reductions()), never when one rank's trainer happens to need a unit first.
void Engine::Impl::finish_reduction(int id) {
  if (!units[size_t(id)].reduction) return;
  if (cfg.stage == 0)
    ZS_THROW(invalid_argument,
             where(id) << ": its gradients of this micro-step are still being reduced; stage 0 "
                          "completes the reductions once every unit of the micro-step is handed "
                          "over (unit '"
                       << layout(reductions.next).name << "' is next)");
  finish_in_order(id);
}

void Engine::Impl::finish_in_order(int id) {
  while (units[size_t(id)].reduction) {
    ZS_CHECK(!reductions.in_flight.empty());
    complete_reduction(reductions.in_flight.front());  // on failure it stays first, its handle kept
    reductions.in_flight.pop_front();
  }
}

// With hierarchical sharding, a reduced shard (summed within its group) is summed across the
// groups too, once its reduce-scatter landed: started here, in the order the reductions were
// issued, so every rank starts them in one order on the replicas' communicator (when, relative
// to the collectives of the group, may differ between ranks: the two communicators progress
// independently). Returns whether it started one.
bool Engine::Impl::cross_groups(int id) {
  Unit& u = units[size_t(id)];
  if (!topo.replica_comm || u.crossed) return false;
  // No before_collective(): the input is the landed reduce-scatter's output, which no work on
  // the device writes (scripts/mutate_waits.py found the wait here unneeded).
  u.reduction = track(topo.replica_comm->all_reduce_sum(
      u.reduced, layout(id).shard_numel, pdt, "unit '" + layout(id).name + "' (across groups)"));
  u.crossed = true;  // not recorded: every reduce-scatter has one, in the same order
  count_sent(true, 2 * int64_t(topo.replicas - 1) * layout(id).shard_numel * int64_t(pbytes) /
                       topo.replicas);
  return true;
}

// Starts the all-reduces across groups of the reductions in flight whose reduce-scatters have
// landed, in the order they were issued, up to the first still running (or failed: its wait
// reports it): so that several are on the link at once, not one after the other. Returns
// whether a reduce-scatter is left to cross once it lands.
bool Engine::Impl::cross_landed() {
  if (!topo.replica_comm) return false;
  for (int v : reductions.in_flight) {
    Unit& w = units[size_t(v)];
    if (!w.reduction || w.crossed) continue;
    if (!w.reduction->done()) return true;
    try {
      w.reduction->wait();  // done: returns at once, or throws its failure
    } catch (const Error&) {
      return false;
    }
    cross_groups(v);
  }
  return false;
}

// Waits for a unit's reduction (its reduce-scatter, and with groups its all-reduce across them).
// On failure the handle stays, so the destructor can wait for it to settle.
void Engine::Impl::land_reduction(int id) {
  Unit& u = units[size_t(id)];
  const std::shared_ptr<Work> scatter = u.reduction;  // wait_for() may cross it meanwhile
  wait_for(*scatter);
  if (cross_groups(id)) cross_landed();
  if (u.crossed) wait_for(*u.reduction);
  u.reduction.reset();
  u.crossed = false;
}

// Waits for a unit's reduction, completes stage 0's all-reduce (reduce-scatter + all-gather
// over the same shards, so every stage sees bitwise the same reduced gradient), and hands the
// micro-step to the state tier.
void Engine::Impl::complete_reduction(int id) {
  Unit& u = units[size_t(id)];
  // Already waited for, and failed after (stage 0's all-gather), which was thrown then: the
  // micro-step is missing, and step() says so.
  if (!u.reduction) return;
  land_reduction(id);
  const UnitLayout& L = layout(id);
  if (cfg.stage == 0) {
    // No before_collective(): the input is the landed reduce-scatter's output, and the work that
    // read the output buffer last was waited for when this micro-step's reduce-scatter started.
    wait_for(*track(topo.shard_comm->all_gather(u.reduced, u.grad_buf.data(), L.shard_numel, pdt,
                                                "unit '" + L.name + "' (gradients)")));
    count_sent(false, group_ring_bytes(id));
    record('g', id);
  }
  if (u.grad_slot >= 0) {
    res.grad_staging.release(u.grad_slot);
    u.grad_slot = -1;
  }
  // A tier that fails to take the gradient (a GPU's copy down, a kernel launch) loses the step
  // on every rank: the failure joins the step's agreed flags (reduce_norm_and_flags()) rather
  // than being thrown here, on one rank, at a moment the others do not share.
  try {
    state->grad_reduced(id, u.micro_done, cfg.stage == 0 ? u.grad_buf.data() : nullptr);
  } catch (const Error& e) {
    if (!reductions.lost_grad) reductions.lost_grad = e;
  }
  ++u.micro_done;
  // The speculative step: the unit's gradient is final, so its update may start now, beside
  // backward, as if the step will neither overflow nor clip; step() keeps it where that held.
  if (u.micro_done == cfg.gradient_accumulation_steps && state->speculates() &&
      !reductions.lost_grad && spec_pause.left == 0) {
    try {
      state->speculate(id, fold_hyper(grad_scale(), steps + 1), steps + 1, nullptr);
    } catch (const std::exception&) {
      // Speculation is only ahead of time: step() updates the unit as usual.
    }
  }
}

// Hands the reductions that already finished to the state tier now, during backward, so that
// step() finds their gradients folded and their share of the norm taken. Completing one is
// local in stages 1–3, so each rank may do it whenever its own have landed; stage 0 completes
// at the point issue_reductions() shares. A failed one is left for step() (or the trainer's
// next need of the unit) to report, as every failed reduction is.
void Engine::Impl::complete_finished() {
  if (cfg.stage == 0) return;
  while (!reductions.in_flight.empty()) {
    if (Work* w = units[size_t(reductions.in_flight.front())].reduction.get()) {
      try {
        cross_landed();  // the front's too, once its reduce-scatter landed
        w = units[size_t(reductions.in_flight.front())].reduction.get();
        if (!w->done()) return;
        w->wait();  // done: returns at once, or throws its failure
      } catch (const Error&) {
        return;  // the unit's own wait reports it
      }
    }
    complete_reduction(reductions.in_flight.front());
    reductions.in_flight.pop_front();
  }
}

// A gradient staging buffer for unit id (stages 2–3). When none holds it, the oldest reduction in
// flight frees one (ranks decide alike). Slots are sized by the largest units (engine_setup.cpp):
// when only a slot too small for this unit is free (the units out took the larger ones), that
// slot grows to its size, so the pool stays within grad_buffers × the largest unit. When the
// units holding them wait for their turn, the pool grows by one: a trainer whose order differs
// from the engine's costs memory, never correctness.
int Engine::Impl::take_grad_staging(int id) {
  BufferPool& pool = res.grad_staging;
  const size_t bytes = size_t(layout(id).padded_numel) * pbytes;
  auto make = [&] {
    return tier_ctx.buffer(Tier::device, MemKind::buffer, "grad_staging", bytes, false);
  };
  int slot = pool.acquire(id, bytes);
  for (size_t i = 0; slot < 0 && i < pool.owner.size(); ++i) {
    const int owner = pool.owner[i];
    if (owner >= 0 && units[size_t(owner)].reduction) {
      finish_reduction(owner);
      slot = pool.acquire(id, bytes);
    }
  }
  if (slot < 0) {  // the largest free slot grows (allocated first: a failure loses nothing)
    int grow = -1;
    for (size_t i = 0; i < pool.owner.size(); ++i)
      if (pool.owner[i] < 0 &&
          (grow < 0 || pool.buffers[i].bytes() > pool.buffers[size_t(grow)].bytes()))
        grow = int(i);
    if (grow >= 0) {
      pool.buffers[size_t(grow)] = make();
      slot = pool.acquire(id, bytes);
    }
  }
  bool waiting = false;
  for (int owner : pool.owner) waiting |= owner >= 0 && units[size_t(owner)].queued;
  if (slot < 0 && waiting) {
    pool.fill(1, make);
    slot = pool.acquire(id, bytes);
  }
  if (slot < 0)
    ZS_THROW(invalid_argument, "grads(): " << where(id) << ": all " << pool.owner.size()
                                           << " gradient buffers hold units not yet marked ready "
                                              "(grad_buffers); call grads_ready() first");
  return slot;
}

std::vector<TensorView> Engine::grads(UnitId id) {
  Impl& m = *impl_;
  m.unit(id, "grads");
  std::vector<TensorView> out = m.take_grads(id, 0);
  m.res.dev->hand_to_trainer();  // the trainer writes into it next
  return out;
}

// The unit's gradient buffer for the trainer, zeroed from element `zero_from` on (the copying
// grads_ready() overwrites the parameters and zeroes only the padding after them).
std::vector<TensorView> Engine::Impl::take_grads(int id, int64_t zero_from) {
  Unit& u = units[size_t(id)];
  if (u.grads_out) return views(id, grad_buffer(id));
  if (reductions.closed)
    ZS_THROW(invalid_argument, "grads(): " << where(id)
                                           << ": clip_grad_norm() closed this step's gradients; "
                                              "call step() (or zero_grad()) first");
  if (u.queued)
    ZS_THROW(invalid_argument,
             "grads(): " << where(id) << ": its gradients of the last micro-step wait for unit '"
                         << layout(reductions.next).name
                         << "' (reductions run from the last registered unit to the first, the "
                            "same on every rank); hand every unit over once per micro-step");
  finish_reduction(id);
  if (u.micro_done >= cfg.gradient_accumulation_steps)
    ZS_THROW(invalid_argument,
             "grads(): " << where(id) << " already has the gradients of " << u.micro_done
                         << " micro-steps (gradient_accumulation_steps = "
                         << cfg.gradient_accumulation_steps << "); call step() first");
  if (cfg.stage >= 2) u.grad_slot = take_grad_staging(id);
  const int64_t padded = layout(id).padded_numel;
  res.dev->fill(static_cast<char*>(grad_buffer(id)) + size_t(zero_from) * pbytes, 0,
                size_t(padded - zero_from) * pbytes);
  u.grads_out = true;
  return views(id, grad_buffer(id));
}

void Engine::grads_ready(UnitId id, const std::vector<TensorView>& src) {
  Impl& m = *impl_;
  m.unit(id, "grads_ready");
  const auto& ps = m.layout(id).params;
  const Compute& dev = *m.res.dev;
  if (src.size() != ps.size())
    ZS_THROW(invalid_argument, "grads_ready(): " << m.where(id) << " has " << ps.size()
                                                 << " parameters, got " << src.size()
                                                 << " gradients");
  for (size_t i = 0; i < ps.size(); ++i) {
    const TensorView& g = src[i];
    if (!g.data) continue;  // no gradient for this parameter in this micro-step
    // The CPU or the engine's own GPU: copies from another GPU would need peer access.
    const bool reachable = g.device == Device::cpu ||
                           (g.device == dev.device() && g.device_index == dev.device_index());
    if (g.numel != ps[i].numel || g.dtype != m.pdt || !reachable)
      ZS_THROW(
          invalid_argument,
          "grads_ready(): " << m.where(id) << ": gradient of '" << ps[i].name << "' has " << g.numel
                            << " elements of " << dtype_name(g.dtype)
                            << (g.device == Device::cpu
                                    ? ""
                                    : " on " + device_string(g.device, g.device_index))
                            << ", expected " << ps[i].numel << " of " << dtype_name(m.pdt)
                            << " on the CPU"
                            << (dev.device() == Device::cpu
                                    ? ""
                                    : " or " + device_string(dev.device(), dev.device_index())));
  }
  // The parameters are packed from element 0 and every one is copied: only the padding after
  // them needs zeros.
  std::vector<TensorView> dst = m.take_grads(id, m.layout(id).numel);
  bool from_host = false;
  std::vector<uint8_t> present(ps.size(), 1);
  for (size_t i = 0; i < ps.size(); ++i) {
    if (!src[i].data) {
      present[i] = 0;
      m.res.dev->fill(dst[i].data, 0, size_t(ps[i].numel) * m.pbytes);
      continue;
    }
    if (src[i].numel) m.res.dev->copy(dst[i].data, src[i].data, src[i].bytes());
    from_host |= src[i].device == Device::cpu;
  }
  // The caller may reuse its host memory once this returns.
  if (from_host) m.res.dev->synchronize();
  m.hand_over(id, present.data());
}

void Engine::grads_ready(UnitId id) {
  impl_->unit(id, "grads_ready");
  impl_->hand_over(id, nullptr);
}

// `present`: per parameter, whether it has a gradient in this micro-step (null: all do).
void Engine::Impl::hand_over(int id, const uint8_t* present) {
  Unit& u = units[size_t(id)];
  if (!u.grads_out)
    ZS_THROW(invalid_argument,
             "grads_ready(): " << where(id) << " has no gradient buffer out; call grads() first");
  for (size_t i = 0; i < u.grad_seen.size(); ++i) u.grad_seen[i] |= present ? present[i] : 1;
  u.grads_out = false;
  u.queued = true;
  issue_reductions();
  complete_finished();
}

// Starts every waiting reduction whose turn has come.
void Engine::Impl::issue_reductions() {
  while (units[size_t(reductions.next)].queued) {
    start_reduction(reductions.next);
    if (reductions.next-- > 0) continue;
    // The micro-step's last reduction: stage 0 completes them all here (see finish_reduction()).
    reductions.next = int(units.size()) - 1;
    if (cfg.stage == 0 && !reductions.in_flight.empty())
      finish_in_order(reductions.in_flight.back());
  }
}

void Engine::Impl::start_reduction(int id) {
  Unit& u = units[size_t(id)];
  u.reduced = state->grad_target(id);
  res.dev->before_collective();
  try {
    u.reduction = track(topo.shard_comm->reduce_scatter(
        grad_buffer(id), u.reduced, layout(id).shard_numel, pdt, "unit '" + layout(id).name + "'"));
  } catch (...) {
    // The collective never started: its target is free again, and the trainer may retry.
    state->grad_abandoned(id);
    u.queued = false;
    u.grads_out = true;
    throw;
  }
  record('r', id);
  count_sent(false, group_ring_bytes(id));
  reductions.in_flight.push_back(id);
  u.queued = false;
  if (!cfg.overlap_comm) finish_in_order(id);
}

void Engine::zero_grad() {
  Impl& m = *impl_;
  if (!m.finalized) return;  // nothing to forget yet (or a failed finalize() left no tiers)
  // Reductions in flight land, and are dropped with the rest (no stage-0 all-gather: their
  // results are forgotten anyway). With groups each still gets its all-reduce across them, so
  // that every rank has issued the same collectives.
  for (int f : m.reductions.in_flight)
    if (m.units[size_t(f)].reduction) m.land_reduction(f);
  m.reductions.in_flight.clear();
  for (size_t i = 0; i < m.units.size(); ++i) {
    Unit& u = m.units[i];
    if (u.grad_slot >= 0) m.res.grad_staging.release(u.grad_slot);
    u.grad_slot = -1;
    u.grads_out = false;
    u.queued = false;
    u.micro_done = 0;
    std::fill(u.grad_seen.begin(), u.grad_seen.end(), 0);
  }
  m.reductions.next = int(m.units.size()) - 1;
  m.reductions.closed.reset();
  m.reductions.clip_now = 0;
  m.reductions.lost_grad.reset();
  m.state->forget_grads();  // issues no device work: nothing to hand over (scripts/mutate_waits.py)
}

}  // namespace zeroshard
