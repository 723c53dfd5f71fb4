// Engine: finishing gradient reductions, and the optimizer step (norm, overflow, clipping,
// fused update, low-precision parameters back in place).
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <limits>

#include "check.hpp"
#include "engine_impl.hpp"

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
  wait_for(*u.reduction);  // on failure the handle stays, so the destructor can wait for it to settle
  u.reduction.reset();
  const UnitLayout& L = u.layout;
  if (cfg.stage == 0)
    wait_for(*track(comm->all_gather(u.grad_shard, u.grad_whole, L.shard_numel, pdt, "unit '" + L.name + "' (gradients)")));
  if (u.grad_slot >= 0) {
    grad_pool.release(u.grad_slot);
    u.grad_slot = -1;
  }
  if (cfg.gradient_accumulation_steps > 1) {
    const void* g = cfg.stage == 0 ? u.grad_whole : u.grad_shard;
    int64_t n = cfg.stage == 0 ? L.padded_numel : L.shard_numel;
    const bool first = u.micro_done == 0;  // acc = g on the first micro-step: no separate zeroing pass
    res.parallel_chunks(n, [&](int64_t b, int64_t e) {
      const void* gb = static_cast<const char*>(g) + size_t(b) * pbytes;
      if (first)
        cpu::convert(res.isa(), gb, pdt, u.accum + b, DType::f32, e - b);
      else
        cpu::accumulate(res.isa(), u.accum + b, gb, pdt, e - b);
    });
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
    u.grads_out = false;
    u.micro_done = 0;
  }
}

StepResult Engine::step() { return impl_->step(); }

StepResult Engine::Impl::step() {
  if (!finalized) ZS_THROW(invalid_argument, "rank " << rank << ": step() before finalize()");
  const int k = cfg.gradient_accumulation_steps;
  for (size_t i = 0; i < units.size(); ++i) finish_reduction(int(i));
  for (Unit& u : units) {
    if (u.grads_out)
      ZS_THROW(invalid_argument, "step(): " << where(u) << " has gradients out that were never marked "
                                               "ready; call grads_ready() first");
    if (u.micro_done != k)
      ZS_THROW(invalid_argument, "step(): " << where(u) << " has the gradients of " << u.micro_done << " of "
                                            << k << " micro-steps (gradient_accumulation_steps); "
                                               "each unit needs grads_ready() once per micro-step");
  }
  for (Unit& u : units) u.micro_done = 0;

  // The gradient each rank owns: its shard (stage 0 reads the same elements of its whole copy).
  auto grad_at = [&](const Unit& u, int64_t shard_rel) -> std::pair<const void*, DType> {
    int64_t base = cfg.stage == 0 ? rank * u.layout.shard_numel : 0;
    if (k > 1) return {u.accum + base + shard_rel, DType::f32};
    const void* g = cfg.stage == 0 ? u.grad_whole : u.grad_shard;
    return {static_cast<const char*>(g) + size_t(base + shard_rel) * pbytes, pdt};
  };

  // One all-reduce carries the sum of squares and the overflow flag.
  double local = 0.0;
  for (const Unit& u : units)
    local += res.parallel_sum(u.layout.shard_numel, [&](int64_t b, int64_t e) {
      auto [g, dt] = grad_at(u, b);
      return cpu::sum_squares(res.isa(), g, dt, e - b);
    });
  double agg[2] = {local, std::isfinite(local) ? 0.0 : 1.0};
  wait_for(*track(comm->all_reduce(agg, 2, ReduceOp::sum, "gradient norm and overflow flag")));

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

  // Hyperparameters per group, folded once in double.
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
    h.grad_scale = float(inv * r.clip_factor);
    hyper.push_back(h);
  }

  // Every (unit, group run) piece of at most kChunk elements is one task, so small units and
  // big ones share the arena evenly.
  struct Task {
    const cpu::UpdateHyper* h;
    cpu::UpdateArgs a;
  };
  std::vector<Task> tasks;
  for (Unit& u : units) {
    const UnitLayout& L = u.layout;
    const int64_t shard_base = rank * L.shard_numel;
    const bool whole = cfg.stage == 0;
    const bool out_needed = !u.master_buf.empty();
    for (const GroupRun& run : whole ? u.whole_runs : u.shard_runs) {
      for (int64_t b = run.begin; b < run.end; b += Resources::kChunk) {
        int64_t e = std::min(run.end, b + Resources::kChunk);
        // Position b is relative to the state's extent: the whole unit in stage 0, else the shard.
        cpu::UpdateArgs a;
        a.master = u.master + b;
        a.state0 = u.state0 ? u.state0 + b : nullptr;
        a.state1 = u.state1 ? u.state1 + b : nullptr;
        if (whole) {
          a.grad = k > 1 ? static_cast<const void*>(u.accum + b)
                         : static_cast<const char*>(u.grad_whole) + size_t(b) * pbytes;
          a.grad_dtype = k > 1 ? DType::f32 : pdt;
        } else {
          auto [g, dt] = grad_at(u, b);
          a.grad = g;
          a.grad_dtype = dt;
        }
        if (out_needed) {
          int64_t pos = cfg.stage == 3 || whole ? b : shard_base + b;
          a.out = static_cast<char*>(u.param) + size_t(pos) * pbytes;
          a.out_dtype = pdt;
        }
        a.n = e - b;
        tasks.push_back({&hyper[size_t(run.group)], a});
      }
    }
  }
  res.parallel_for(int64_t(tasks.size()), [&](int64_t t) {
    cpu::optimizer_update(res.isa(), *tasks[size_t(t)].h, tasks[size_t(t)].a);
  });

  // Stages 1–2 keep whole parameters: each rank contributes its updated shard.
  if (cfg.stage == 1 || cfg.stage == 2) {
    std::vector<std::shared_ptr<Work>> works;
    for (Unit& u : units) {
      char* own = static_cast<char*>(u.param) + size_t(rank * u.layout.shard_numel) * pbytes;
      works.push_back(track(comm->all_gather(own, u.param, u.layout.shard_numel, pdt, "unit '" + u.layout.name + "' (parameters)")));
    }
    for (auto& w : works) wait_for(*w);
  }
  r.optimizer_s = now_s() - t_update;
  scaler.update(false);
  r.loss_scale = scaler.scale();
  r.step = steps;
  close_interval();
  return r;
}

}  // namespace zeroshard
