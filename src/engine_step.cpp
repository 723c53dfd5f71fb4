// Engine: the optimizer step. It reads as the algorithm: finish the reductions, settle the
// gradients where the state tier keeps them, one all-reduce of [sum of squares, overflow flag,
// failure flag], the update on the tier that holds the state (new low-precision shards to the
// parameter tier), and the all-gather of the new parameters (stages 1–2).
#include <algorithm>
#include <chrono>
#include <cmath>
#include <limits>
#include <utility>

#include "base/agree.hpp"
#include "base/check.hpp"
#include "src/engine_impl.hpp"

namespace zeroshard {

static double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

void Engine::Impl::wait_for(Work& w) {
  struct Count {
    double t0 = now_s();
    double& total;
    ~Count() { total += now_s() - t0; }
  } count{now_s(), clock.exposed_s};
  wait_crossing(w);
}

// With hierarchical sharding, a wait also keeps starting the all-reduces across groups of the
// reductions that land meanwhile (cross_landed()): the replica in another group waits for this
// rank's, whatever this rank waits for. Otherwise a wait on the group (a gather) and a wait
// across (a reduction landed in another order, as a free gradient buffer decides) close a
// cycle round the ranks: each waits for a peer that waits for the next.
void Engine::Impl::wait_crossing(Work& w) {
  while (!w.done() && cross_landed()) w.wait_settled(kCrossPollS);
  w.wait();
}

// Wall time covered by at least one of the collectives (they overlap one another).
static double busy_union(std::vector<std::shared_ptr<Work>>& works) {
  std::vector<std::pair<double, double>> iv;
  for (auto& w : works)
    if (w->finished_at() > 0) iv.emplace_back(w->started_at(), w->finished_at());
  std::sort(iv.begin(), iv.end());
  double busy = 0, end = -1;
  for (auto [b, e] : iv) {
    if (b > end) {
      busy += e - b;
      end = e;
    } else if (e > end) {
      busy += e - end;
      end = e;
    }
  }
  works.clear();
  return busy;
}

StepResult Engine::step() {
  // The whole step, not its update alone: the gradient pass before the update takes the
  // memory's bandwidth as well (benchmarks/results/offload.md, "The save gives way").
  struct Stepping {  // however step() ends
    std::atomic<bool>& on;
    explicit Stepping(std::atomic<bool>& f) : on(f) { on = true; }
    ~Stepping() { on = false; }
  } stepping(impl_->stepping);
  StepResult r = impl_->step();
  impl_->res.dev->hand_to_trainer();  // the trainer reads the new parameters next
  return r;
}

// A unit prefetched during backward holds the parameters from before this step, and its
// all-gather reads the shard the update is about to write: let it land, then drop it.
void Engine::Impl::drop_prefetches() {
  for (size_t i = 0; i < units.size(); ++i)
    if (units[i].gather_slot >= 0 && !units[i].gathered) {
      wait_for(*units[i].gather_work);
      free_gather(int(i));
    }
}

// The update, all or nothing across ranks (a failure throws on every rank and leaves the state
// of the last step). The parameter tier takes the new shards its own way (ParamTier::update).
void Engine::Impl::update(const std::vector<cpu::UpdateHyper>& hyper) {
  drop_prefetches();  // one started after clip_grad_norm() (close_grads() dropped the earlier)
  params->drop_reads();
  before_state_change();
  muon.hyper = &hyper;
  struct Forget {
    const std::vector<cpu::UpdateHyper>*& h;
    ~Forget() { h = nullptr; }
  } forget{muon.hyper};
  params->update(*state, hyper, steps);
}

// Every unit's reductions of this step finished and handed to the state tier.
void Engine::Impl::finish_micro_steps() {
  if (!finalized) ZS_THROW(invalid_argument, "rank " << rank << ": step() before finalize()");
  const int k = cfg.gradient_accumulation_steps;
  bool waiting = false;
  for (const Unit& u : units) waiting |= u.queued;
  if (waiting)  // handed over, but waiting for a unit that never was
    ZS_THROW(invalid_argument,
             "step(): " << where(reductions.next) << " has the gradients of "
                        << units[size_t(reductions.next)].micro_done << " of " << k
                        << " micro-steps (gradient_accumulation_steps); the units handed over "
                           "after it wait for it (reductions run from the last registered unit "
                           "to the first, the same on every rank)");
  for (size_t i = 0; i < units.size(); ++i) finish_in_order(int(i));
  for (size_t i = 0; i < units.size(); ++i) {
    const Unit& u = units[i];
    if (u.grads_out)
      ZS_THROW(invalid_argument, "step(): " << where(int(i))
                                            << " has gradients out that were never marked "
                                               "ready; call grads_ready() first");
    if (u.micro_done != k)
      ZS_THROW(invalid_argument, "step(): " << where(int(i)) << " has the gradients of "
                                            << u.micro_done << " of " << k
                                            << " micro-steps (gradient_accumulation_steps); "
                                               "each unit needs grads_ready() once per micro-step");
  }
}

// The step's one all-reduce: the sum of squares, the overflow flag, whether a gradient failed to
// reach its tier (the nvme tier's disk, a GPU's copy down) or come back from it, and the hash of
// this rank's collectives since the last step (check_same_collectives()): a mix-up or a lost
// gradient is found here, on every rank, before anything is applied. Returns {Σg², overflow}.
std::pair<double, bool> Engine::Impl::reduce_norm_and_flags() {
  std::optional<Error> grad_error = state->settle_grads();
  if (!grad_error) grad_error = reductions.lost_grad;
  reductions.lost_grad.reset();
  const double local = state->sum_squares();
  const double h = double(collectives.hash & 0xfffff);
  // Every group holds the whole gradient: the first one's shards make the norm. Then, per
  // parameter, whether this rank had a gradient for it: one held by every rank is left alone.
  std::vector<double> agg = {topo.replica == 0 ? local : 0.0, std::isfinite(local) ? 0.0 : 1.0,
                             grad_error ? 1.0 : 0.0, h, h * h};
  for (const Unit& u : units)
    for (uint8_t seen : u.grad_seen) agg.push_back(seen ? 1.0 : 0.0);
  wait_for(*track(comm->all_reduce(agg.data(), int64_t(agg.size()), ReduceOp::sum,
                                   "gradient norm and overflow flag")));
  check_same_collectives(agg.data() + 3);
  size_t k = 5;
  for (Unit& u : units) {
    for (size_t i = 0; i < u.held.size(); ++i) u.held[i] = agg[k++] == 0.0;
    std::fill(u.grad_seen.begin(), u.grad_seen.end(), 0);
  }
  collectives.issued.clear();
  collectives.hash = 0;
  if (agg[2] > 0) {
    // Some rank lost a gradient shard: no rank may update. The state stays at the last step.
    state->forget_grads();
    std::optional<Error> e =
        agree(*comm, grad_error, "step " + std::to_string(steps + 1) + " (gradients)");
    ZS_CHECK(e.has_value());
    throw Error(e->code(), std::string(e->what()) + not_applied(steps + 1));
  }
  return {agg[0], agg[1] > 0 || !std::isfinite(agg[0])};
}

// This step's gradients, reduced and agreed on: the part of step() that clip_grad_norm() runs
// ahead of it.
std::pair<double, bool> Engine::Impl::close_grads() {
  if (reductions.closed) return *reductions.closed;
  finish_micro_steps();
  for (Unit& u : units) u.micro_done = 0;
  // Stage 3 prefetch follows the gather order of the first step from now on.
  if (!schedule.order.empty()) schedule.recorded = true;
  schedule.pos = 0;
  drop_prefetches();
  reductions.closed = reduce_norm_and_flags();
  return *reductions.closed;
}

double Engine::clip_grad_norm(double max_norm) {
  Impl& m = *impl_;
  if (!(max_norm >= 0) || !std::isfinite(max_norm))
    ZS_THROW(invalid_argument,
             "clip_grad_norm(): max_norm must be a finite number >= 0, got " << max_norm);
  const auto [sumsq, overflow] = m.close_grads();
  // Clipping twice clips at the smaller threshold, as two clip_grad_norm_ calls in torch do.
  if (max_norm > 0)
    m.reductions.clip_now =
        m.reductions.clip_now > 0 ? std::min(m.reductions.clip_now, max_norm) : max_norm;
  return overflow ? std::numeric_limits<double>::infinity() : std::sqrt(sumsq) * m.grad_scale();
}

// What the summed, loss-scaled gradients are multiplied by: the mean over micro-steps and
// ranks, unscaled.
double Engine::Impl::grad_scale() const {
  return 1.0 / (double(world) * cfg.gradient_accumulation_steps * scaler.scale());
}

void Engine::Impl::check_state(const char* call) const {
  if (!failed_load.empty())
    ZS_THROW(invalid_argument, "rank " << rank << ": " << call
                                       << "(): the engine holds no valid state: " << failed_load
                                       << " -- load a checkpoint first");
}

StepResult Engine::Impl::step() {
  check_state("step");
  const auto [sumsq, overflow] = close_grads();
  reductions.closed.reset();
  const double clip_next = std::exchange(reductions.clip_now, 0.0);
  StepResult r;
  auto close_interval = [&] {
    double now = now_s();
    r.comm_busy_s = busy_union(clock.works);
    r.comm_exposed_s = clock.exposed_s;
    r.interval_s = now - clock.interval_start;
    r.comm_bytes = std::exchange(collectives.sent_bytes, 0);
    r.inter_node_bytes = std::exchange(collectives.sent_inter, 0);
    clock.exposed_s = 0;
    clock.interval_start = now;
  };
  const double inv = grad_scale();
  r.grad_norm = std::sqrt(sumsq) * inv;
  if (overflow && scaler.at_floor()) {
    state->forget_grads();
    ZS_THROW(overflow, "step() on rank "
                           << rank << ": step " << steps + 1
                           << " overflowed with the loss scale already at its minimum ("
                           << scaler.scale()
                           << ", fp16.min_loss_scale = " << scaler.options().min_scale
                           << "): every later step would be skipped too; nothing was applied. "
                              "Lower min_loss_scale, lower the learning rate, or train in bf16");
  }
  const bool automatic = cfg.speculative_step == SpeculativeStep::automatic;
  if (overflow) {
    state->forget_grads();
    r.speculation_dropped = state->speculated().dropped;
    if (automatic) spec_pause.after_step(r.speculation_dropped > 0, 0);
    scaler.update(true);
    r.skipped = true;
    r.grad_norm = std::numeric_limits<double>::infinity();
    r.loss_scale = scaler.scale();
    r.step = steps;
    close_interval();
    return r;
  }
  const double clip =
      clip_next > 0 && (cfg.gradient_clipping <= 0 || clip_next < cfg.gradient_clipping)
          ? clip_next
          : cfg.gradient_clipping;
  r.clip_factor = clip > 0 && r.grad_norm > clip ? clip / (r.grad_norm + 1e-6) : 1.0;
  ++steps;
  const double t_update = now_s(), waited = clock.exposed_s;
  try {
    mark_held_runs();
    update(fold_hyper(inv * r.clip_factor, steps));
  } catch (...) {
    --steps;
    throw;
  }
  // The update alone: the all-gather that follows is communication, counted as such, and so
  // are Muon's exchanges inside the update (wait_for() counted them).
  r.optimizer_s = now_s() - t_update - (clock.exposed_s - waited);
  r.newton_schulz_s = std::exchange(muon.ns_s, 0.0);
  r.speculation_kept = state->speculated().kept;
  r.speculation_dropped = state->speculated().dropped;
  if (automatic)
    spec_pause.after_step(r.speculation_kept + r.speculation_dropped > 0, r.speculation_kept);
  // Stages 1–2 keep whole parameters: each rank contributes its updated shard.
  if (cfg.stage == 1 || cfg.stage == 2) {
    std::vector<std::shared_ptr<Work>> works;
    res.dev->before_collective();
    for (size_t i = 0; i < units.size(); ++i) {
      works.push_back(track(topo.shard_comm->all_gather(
          params->own(int(i)), params->whole(int(i)), layout(int(i)).shard_numel, pdt,
          "unit '" + layout(int(i)).name + "' (parameters)")));
      count_sent(false, group_ring_bytes(int(i)));
    }
    for (auto& w : works) wait_for(*w);
  }
  scaler.update(false);
  r.loss_scale = scaler.scale();
  r.step = steps;
  close_interval();
  return r;
}

// Hyperparameters per group, folded once in double.
std::vector<cpu::UpdateHyper> Engine::Impl::fold_hyper(double grad_scale, int64_t step) const {
  std::vector<cpu::UpdateHyper> hyper;
  for (const OptimizerOptions& g : groups) {
    cpu::UpdateHyper h;
    h.kind = g.kind;
    h.lr = g.lr;
    h.beta1 = g.beta1;
    h.beta2 = g.beta2;
    h.eps = g.eps;
    h.weight_decay = g.weight_decay;
    h.momentum = g.momentum;
    h.nesterov = g.nesterov;
    h.bias_correction1 = float(1.0 - std::pow(double(g.beta1), double(step)));
    h.bias_correction2 = float(1.0 - std::pow(double(g.beta2), double(step)));
    h.grad_scale = float(grad_scale);
    hyper.push_back(h);
  }
  cpu::UpdateHyper hold;  // mark_held_runs()'s group
  hold.kind = groups.front().kind;
  hold.hold = true;
  hyper.push_back(hold);
  return hyper;
}

void Engine::Impl::mark_held_runs() {
  for (size_t i = 0; i < units.size(); ++i) {
    Unit& u = units[i];
    const bool any = std::find(u.held.begin(), u.held.end(), 1) != u.held.end();
    if (!any && !u.runs_hold) continue;
    UnitShape& s = shapes[i];
    UnitLayout marked = s.layout;
    for (size_t j = 0; j < u.held.size(); ++j)
      if (u.held[j]) marked.params[j].group = int(groups.size());
    const int64_t n = marked.shard_numel;
    s.whole_runs = marked.runs(0, marked.padded_numel);
    s.shard_runs = marked.runs(topo.shard_rank * n, (topo.shard_rank + 1) * n);
    u.runs_hold = any;
  }
}

}  // namespace zeroshard
