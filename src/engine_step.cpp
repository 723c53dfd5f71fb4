// Engine: finishing gradient reductions, and the optimizer step (norm, overflow, clipping,
// fused update, low-precision parameters back in place).
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <limits>

#include "src/base/check.hpp"
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
  } count{now_s(), exposed_s};
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

// Waits for a unit's reduce-scatter, completes stage 0's all-reduce (reduce-scatter + all-gather
// over the same shards, so every stage sees bitwise the same reduced gradient), and folds the
// micro-step into the f32 accumulator.
void Engine::Impl::finish_reduction(int id) {
  Unit& u = units[size_t(id)];
  if (!u.reduction) return;
  // On failure the handle stays, so the destructor can wait for it to settle.
  wait_for(*u.reduction);
  u.reduction.reset();
  const UnitLayout& L = u.layout;
  if (cfg.stage == 0) {
    dev->before_collective();
    wait_for(*track(comm->all_gather(u.grad_shard, u.grad_whole, L.shard_numel, pdt,
                                     "unit '" + L.name + "' (gradients)")));
  }
  if (u.grad_slot >= 0) {
    grad_pool.release(u.grad_slot);
    u.grad_slot = -1;
  }
  if (u.shard_slot >= 0) {  // the reduced shard comes down to the host tier
    dev->download(u.grad_shard, shard_pool.buffers[size_t(u.shard_slot)].data(),
                  size_t(L.shard_numel) * pbytes);
    shard_pool.release(u.shard_slot);
    u.shard_slot = -1;
  }
  if (opt_nvme()) {  // the gradient goes to the nvme tier's cache (engine_offload.cpp)
    nvme_grad_reduced(id);
    ++u.micro_done;
    return;
  }
  if (cfg.gradient_accumulation_steps > 1) {
    const void* g = cfg.stage == 0 ? u.grad_whole : u.grad_shard;
    int64_t n = cfg.stage == 0 ? L.padded_numel : L.shard_numel;
    // acc = g on the first micro-step: no separate zeroing pass.
    if (u.micro_done == 0)
      opt_compute().convert(g, pdt, u.accum, DType::f32, n);
    else
      opt_compute().accumulate(u.accum, g, pdt, n);
  }
  ++u.micro_done;
}

void Engine::zero_grad() {
  Impl& m = *impl_;
  for (size_t i = 0; i < m.units.size(); ++i) {
    m.finish_reduction(int(i));
    Unit& u = m.units[i];
    if (u.grad_slot >= 0) m.grad_pool.release(u.grad_slot);
    u.grad_slot = -1;
    if (u.shard_slot >= 0) m.shard_pool.release(u.shard_slot);
    u.shard_slot = -1;
    u.grads_out = false;
    u.micro_done = 0;
  }
  if (m.opt_nvme()) m.nvme_forget_grads();
}

StepResult Engine::step() {
  return impl_->step();
}

StepResult Engine::Impl::step() {
  if (!finalized) ZS_THROW(invalid_argument, "rank " << rank << ": step() before finalize()");
  const int k = cfg.gradient_accumulation_steps;
  for (size_t i = 0; i < units.size(); ++i) finish_reduction(int(i));
  for (Unit& u : units) {
    if (u.grads_out)
      ZS_THROW(invalid_argument, "step(): " << where(u)
                                            << " has gradients out that were never marked "
                                               "ready; call grads_ready() first");
    if (u.micro_done != k)
      ZS_THROW(invalid_argument, "step(): " << where(u) << " has the gradients of " << u.micro_done
                                            << " of " << k
                                            << " micro-steps (gradient_accumulation_steps); "
                                               "each unit needs grads_ready() once per micro-step");
  }
  for (Unit& u : units) u.micro_done = 0;
  // Stage 3 prefetch follows the gather order of the first step from now on.
  if (!gather_order.empty()) order_recorded = true;
  gather_pos = 0;
  // A unit prefetched during backward holds the parameters from before this step, and its
  // all-gather reads the shard the update is about to write: let it land, then drop it.
  for (Unit& u : units)
    if (u.gather_slot >= 0 && !u.gathered) {
      wait_for(*u.gather_work);
      gather_pool.release(u.gather_slot);
      u.gather_slot = -1;
      u.gather_work.reset();
    }

  // The gradient each rank owns: its shard (stage 0 reads the same elements of its whole copy).
  auto grad_at = [&](const Unit& u, int64_t shard_rel) -> std::pair<const void*, DType> {
    int64_t base = cfg.stage == 0 ? rank * u.layout.shard_numel : 0;
    if (k > 1) return {u.accum + base + shard_rel, DType::f32};
    const void* g = cfg.stage == 0 ? u.grad_whole : u.grad_shard;
    return {static_cast<const char*>(g) + size_t(base + shard_rel) * pbytes, pdt};
  };

  // One all-reduce carries the sum of squares, the overflow flag and (nvme tier) whether a
  // gradient failed to reach the disk or come back from it.
  double local = 0.0;
  std::optional<Error> grad_error;
  if (opt_nvme()) {
    grad_error = nvme_settle_grads();
    local = nvme_sumsq();  // taken per unit when its gradient was final, summed in unit order
  } else {
    std::vector<GradSpan> spans;
    for (const Unit& u : units) {
      auto [g, dt] = grad_at(u, 0);
      spans.push_back({g, dt, u.layout.shard_numel});
    }
    auto [sum, nonfinite] = opt_compute().sum_squares(spans);
    local = nonfinite ? std::numeric_limits<double>::infinity() : sum;
  }
  double agg[3] = {local, std::isfinite(local) ? 0.0 : 1.0, grad_error ? 1.0 : 0.0};
  wait_for(*track(comm->all_reduce(agg, 3, ReduceOp::sum, "gradient norm and overflow flag")));
  if (agg[2] > 0) {
    // Some rank lost a gradient shard: no rank may update. The state stays at the last step.
    nvme_forget_grads();
    std::optional<Error> e =
        agree(grad_error, "step " + std::to_string(steps + 1) + " (gradient swap)");
    ZS_CHECK(e.has_value());
    throw Error(e->code(), std::string(e->what()) + not_applied(steps + 1));
  }

  StepResult r;
  auto close_interval = [&] {
    double now = now_s();
    r.comm_busy_s = busy_union(step_works);
    r.comm_exposed_s = exposed_s;
    r.interval_s = now - interval_start;
    exposed_s = 0;
    interval_start = now;
  };
  const double scale = scaler.scale();
  const bool overflow = agg[1] > 0 || !std::isfinite(agg[0]);
  const double inv = 1.0 / (double(world) * k * scale);
  r.grad_norm = std::sqrt(agg[0]) * inv;
  if (overflow) {
    if (opt_nvme()) nvme_forget_grads();
    scaler.update(true);
    r.skipped = true;
    r.grad_norm = std::numeric_limits<double>::infinity();
    r.loss_scale = scaler.scale();
    r.step = steps;
    close_interval();
    return r;
  }
  const double clip = cfg.gradient_clipping;
  r.clip_factor = clip > 0 && r.grad_norm > clip ? clip / (r.grad_norm + 1e-6) : 1.0;
  ++steps;
  const double t_update = now_s();

  const std::vector<cpu::UpdateHyper> hyper = fold_hyper(inv * r.clip_factor);
  // The last step's uploads must land before the update rewrites their buffers.
  if (uploads_pending) {
    dev->synchronize();
    uploads_pending = false;
  }
  if (opt_nvme() || par_nvme()) {
    // The nvme tier commits the step on every rank or on none; on failure it restores what it
    // changed in memory and throws, leaving the state of the last completed step.
    try {
      if (opt_nvme())
        nvme_update(hyper);
      else
        nvme_param_update(hyper);
    } catch (...) {
      --steps;
      throw;
    }
  } else {
    std::vector<UnitUpdate> updates;
    for (Unit& u : units) {
      const bool whole = cfg.stage == 0;
      const void* g = k > 1   ? static_cast<const void*>(u.accum)
                      : whole ? u.grad_whole
                              : u.grad_shard;
      // Stage 0 updates the whole unit; the others their shard, whose copy-out lands in the
      // rank's part of the whole parameters (stages 1–2) or in the parameter shard (stage 3),
      // or, when those are on a GPU and the update on the CPU, in the upload buffer.
      void* out = nullptr;
      if (staged())
        out = u.param_upload_buf.data();
      else if (!u.master_buf.empty())
        out = own_param(u);
      updates.push_back(
          unit_update(u, u.master, u.state0, u.state1, g, k > 1 ? DType::f32 : pdt, out));
    }
    if (staged()) {
      // Unit by unit, so each unit's upload to the GPU overlaps the next one's update.
      for (size_t i = 0; i < units.size(); ++i) {
        host->update(hyper, {updates[i]});
        upload_params(units[i]);
      }
    } else {
      opt_compute().update(hyper, updates);
    }
  }

  // The update alone: the all-gather that follows is communication, counted as such.
  r.optimizer_s = now_s() - t_update;
  // Stages 1–2 keep whole parameters: each rank contributes its updated shard.
  if (cfg.stage == 1 || cfg.stage == 2) {
    std::vector<std::shared_ptr<Work>> works;
    dev->before_collective();
    for (Unit& u : units) {
      works.push_back(track(comm->all_gather(own_param(u), u.param, u.layout.shard_numel, pdt,
                                             "unit '" + u.layout.name + "' (parameters)")));
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
std::vector<cpu::UpdateHyper> Engine::Impl::fold_hyper(double grad_scale) const {
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
    h.bias_correction1 = float(1.0 - std::pow(double(g.beta1), double(steps)));
    h.bias_correction2 = float(1.0 - std::pow(double(g.beta2), double(steps)));
    h.grad_scale = float(grad_scale);
    hyper.push_back(h);
  }
  return hyper;
}

// Positions are relative to the state's extent (the whole unit in stage 0, else the shard), and
// so are the gradient's and the copy-out's: every tier runs the same update on the same values.
UnitUpdate Engine::Impl::unit_update(const Unit& u, float* master, float* state0, float* state1,
                                     const void* grad, DType grad_dtype, void* out) const {
  UnitUpdate w;
  w.runs = cfg.stage == 0 ? &u.whole_runs : &u.shard_runs;
  w.args.master = master;
  w.args.state0 = state0;
  w.args.state1 = state1;
  w.args.grad = grad;
  w.args.grad_dtype = grad_dtype;
  if (out) {
    w.args.out = out;
    w.args.out_dtype = pdt;
  }
  w.args.n = cfg.stage == 0 ? u.layout.padded_numel : u.layout.shard_numel;
  return w;
}

void Engine::Impl::unit_tasks(const Unit& u, const std::vector<cpu::UpdateHyper>& hyper,
                              float* master, float* state0, float* state1, const void* grad,
                              DType grad_dtype, void* out, std::vector<UpdateTask>& tasks) const {
  append_update_tasks(hyper, unit_update(u, master, state0, state1, grad, grad_dtype, out), tasks);
}

}  // namespace zeroshard
