// The speculative step (Config::speculative_step) against the step without it, in one process.
//
// Two world-1 engines (self communicator, bf16 parameters, AdamW state on the host tier, or with
// --nvme DIR on the nvme tier in DIR) of N parameters in units of U, one with speculative_step,
// at --stage 3 (the new shards swapped in as the parameters at step()) or 2 (copied into the
// trainer's whole parameters). --grad-buffers sets the nvme tier's gradient cache (that many
// slots plus one; a speculation not started when its gradient must make room is dropped). --device
// async runs them on the asynchronous CPU device without its jitter: the GPU's path (gradients
// down to the host tier, the new shards up from the pinned upload buffers the speculation
// wrote, on the device's copy thread). The trainer plays a
// GPU's backward: from the last unit to the first it waits --backward-ms without using the
// CPU, the time a GPU would take for the unit's backward (a stated wait: the figure is what a
// machine whose backward runs on a GPU sees), then hands the unit's gradient over (the copying
// grads_ready(), as a copy down from the GPU lands it). Then step(). Timed, on the wall clock:
//   backward  the hand-overs and waits;
//   wait      step() after backward: what the trainer (the GPU) waits for before its next
//             forward;
//   update    its part in the update (StepResult::optimizer_s: with every speculation kept,
//             the wait for the last units' and the new shards' copy into the parameters);
// for three steps, alternated round by round so drift hits all alike:
//   off       the engine without speculation;
//   kept      the speculative engine, a step that neither clips nor overflows (every unit's
//             update done during backward is kept);
//   rollback  the speculative engine, clip_grad_norm() below the norm: every unit's
//             speculation is dropped and updated again in step().
// Beside them, predict_step()'s optimizer_s for the speculative engine (its rollback_s for the
// rollback), from the update rate the engine without speculation measured in this run
// (StepResult::optimizer_s) and a compute of 1.5 × the backward played (predict_step() takes
// backward as 2/3 of it). On nvme the "update" is the whole swapped step (nvme_s).
//
// --phases P holds one engine at a time, for models whose two engines do not fit in memory
// together (1 B parameters on the host tier): P pairs of phases, the engine without speculation
// first in even pairs and second in odd ones; each phase builds its engine, runs two untimed
// rounds, then rounds / P timed ones (the speculative engine alternating kept and rollback
// steps), and frees it. The ratios are each pair's medians (P values, not one per round).
//
//   speculative_step_bench [--n 100000000] [--unit 4000000] [--backward-ms 5] [--threads 2]
//                          [--rounds 7] [--device cpu|async] [--stage 3] [--nvme DIR]
//                          [--grad-buffers 2] [--moments f32|bf16] [--phases P]

#include <tbb/global_control.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "benchmarks/bench_util.hpp"
#include "kernels/cpu/cpu_kernels.hpp"
#include "zeroshard/zeroshard.hpp"

namespace zc = zeroshard::cpu;
using namespace zeroshard;
using zs_bench::median;

namespace {

struct Options {
  int64_t n = 100000000;
  int64_t unit = 4000000;
  double backward_ms = 5;
  int threads = 2;
  int rounds = 7;
  bool async = false;
  int stage = 3;
  std::string nvme;       // empty: the host tier
  int grad_buffers = -1;  // -1: the engine's default
  StateFormat moments = StateFormat::f32;
  int phases = 0;  // 0: both engines at once, rounds alternated
};

[[noreturn]] void usage(const std::string& why) {
  std::fprintf(stderr,
               "%s\nusage: speculative_step_bench [--n N] [--unit U] [--backward-ms MS] "
               "[--threads T] [--rounds R>=7] [--device cpu|async] [--stage 1|2|3] "
               "[--nvme DIR] [--grad-buffers B] [--moments f32|bf16] [--phases P]\n",
               why.c_str());
  std::exit(2);
}

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (i + 1 >= argc) usage("missing value after " + arg);
    const char* val = argv[++i];
    if (arg == "--n")
      o.n = std::atoll(val);
    else if (arg == "--unit")
      o.unit = std::atoll(val);
    else if (arg == "--backward-ms")
      o.backward_ms = std::atof(val);
    else if (arg == "--threads")
      o.threads = std::atoi(val);
    else if (arg == "--rounds")
      o.rounds = std::atoi(val);
    else if (arg == "--device" && (std::string(val) == "cpu" || std::string(val) == "async"))
      o.async = std::string(val) == "async";
    else if (arg == "--stage")
      o.stage = std::atoi(val);
    else if (arg == "--nvme")
      o.nvme = val;
    else if (arg == "--grad-buffers")
      o.grad_buffers = std::atoi(val);
    else if (arg == "--moments" && (std::string(val) == "f32" || std::string(val) == "bf16"))
      o.moments = std::string(val) == "f32" ? StateFormat::f32 : StateFormat::bf16;
    else if (arg == "--phases")
      o.phases = std::atoi(val);
    else
      usage("unknown flag " + arg);
  }
  if (o.unit < 2 || o.n < o.unit || o.n % o.unit != 0) usage("--unit must divide --n");
  if (!(o.backward_ms >= 0)) usage("bad --backward-ms");
  if (o.threads < 1) usage("bad --threads");
  if (o.rounds < 7) usage("--rounds must be at least 7 (rule 9)");
  if (o.stage < 1 || o.stage > 3) usage("--stage must be 1, 2 or 3");
  if (o.phases < 0 || (o.phases > 0 && o.rounds % o.phases != 0))
    usage("--phases must divide --rounds");
  return o;
}

std::unique_ptr<Engine> make_engine(const Options& o, bool speculative) {
  Config cfg;
  cfg.stage = o.stage;
  cfg.dtype = DType::bf16;
  cfg.offload_optimizer.tier = o.nvme.empty() ? Tier::host : Tier::nvme;
  if (!o.nvme.empty()) cfg.offload_optimizer.nvme_paths = {o.nvme};
  if (o.grad_buffers >= 1) cfg.grad_buffers = o.grad_buffers;
  cfg.optimizer_state = o.moments;
  cfg.optimizer.kind = OptimizerKind::adamw;
  cfg.optimizer.lr = 1e-4f;
  cfg.optimizer.weight_decay = 0.01f;
  cfg.speculative_step = speculative ? SpeculativeStep::on : SpeculativeStep::off;
  cfg.async_device = o.async;
  auto e = std::make_unique<Engine>(cfg, make_self_communicator());
  for (int64_t u = 0; u < o.n / o.unit; ++u)
    e->add_unit("layer" + std::to_string(u), {Param{"w", {o.unit}}});
  e->finalize();
  return e;
}

// The CPU update's rate (parameters per second) on this machine: a host-tier engine of one unit,
// its median over 7 steps after 2 untimed ones. The planner times the nvme tier's last
// speculation by it (what overlaps no I/O).
double cpu_update_rate(const Options& o, const std::vector<uint16_t>& grad) {
  Options one = o;
  one.n = o.unit;
  one.nvme.clear();
  std::unique_ptr<Engine> e = make_engine(one, false);
  std::vector<double> s;
  for (int r = 0; r < 9; ++r) {
    e->grads_ready(0, {TensorView{const_cast<uint16_t*>(grad.data()), o.unit, DType::bf16}});
    const double t = e->step().optimizer_s;
    if (r >= 2) s.push_back(t);
  }
  return double(o.unit) / median(s);
}

struct Times {
  std::vector<double> backward, wait, update;
  int kept = 0, dropped = 0;
};

void append(Times& to, const Times& from) {
  to.backward.insert(to.backward.end(), from.backward.begin(), from.backward.end());
  to.wait.insert(to.wait.end(), from.wait.begin(), from.wait.end());
  to.update.insert(to.update.end(), from.update.begin(), from.update.end());
  to.kept += from.kept;
  to.dropped += from.dropped;
}

// One training step: the backward the trainer plays, then step() (after clip_grad_norm() with
// `clip`, when > 0).
void train_step(Engine& e, const Options& o, const std::vector<uint16_t>& grad, double clip,
                Times& t) {
  const auto t0 = std::chrono::steady_clock::now();
  for (int64_t u = o.n / o.unit - 1; u >= 0; --u) {
    std::this_thread::sleep_for(std::chrono::duration<double, std::milli>(o.backward_ms));
    TensorView g;
    g.data = const_cast<uint16_t*>(grad.data()) + u * o.unit;
    g.numel = o.unit;
    g.dtype = DType::bf16;
    e.grads_ready(int(u), {g});
  }
  t.backward.push_back(zs_bench::seconds_since(t0));
  const auto t1 = std::chrono::steady_clock::now();
  if (clip > 0) e.clip_grad_norm(clip);
  const StepResult r = e.step();
  t.wait.push_back(zs_bench::seconds_since(t1));
  t.update.push_back(r.optimizer_s);
  if (r.skipped) usage("the engine skipped a step: the benchmark's gradients overflowed");
  t.kept += r.speculation_kept;
  t.dropped += r.speculation_dropped;
}

std::string range(const std::vector<double>& v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.3f (%.3f–%.3f)", median(v),
                *std::min_element(v.begin(), v.end()), *std::max_element(v.begin(), v.end()));
  return buf;
}

}  // namespace

int main(int argc, char** argv) {
  const Options o = parse(argc, argv);
  setenv("ZEROSHARD_CPU_THREADS", std::to_string(o.threads).c_str(), 1);
  setenv("ZEROSHARD_ASYNC_JITTER_US", "0", 1);  // the device's own speed, no test delays
  tbb::global_control limit(tbb::global_control::max_allowed_parallelism, size_t(o.threads));
  double load[3] = {0, 0, 0};
  getloadavg(load, 3);
  std::printf(
      "speculative_step_bench: device %s, stage %d, state on %s, %s moments, n=%lld unit=%lld "
      "backward %.1f ms per unit, threads=%d rounds=%d, load average %.2f\n\n",
      o.async ? "async" : "cpu", o.stage, o.nvme.empty() ? "host" : o.nvme.c_str(),
      state_format_name(o.moments), (long long)o.n, (long long)o.unit, o.backward_ms, o.threads,
      o.rounds, load[0]);
  std::vector<uint16_t> grad(size_t(o.n));
  for (int64_t i = 0; i < o.n; ++i)
    grad[size_t(i)] = zc::float_to_bf16(zs_bench::hashed(i, -1e-3f, 1e-3f));
  Times t_off, t_kept, t_back;
  std::vector<double> kept_ratio, back_ratio;
  Config spec_cfg;
  if (o.phases == 0) {
    std::unique_ptr<Engine> off = make_engine(o, false), on = make_engine(o, true);
    spec_cfg = on->config();
    auto run_off = [&](Times& t) { train_step(*off, o, grad, 0, t); };
    auto run_kept = [&](Times& t) { train_step(*on, o, grad, 0, t); };
    auto run_back = [&](Times& t) { train_step(*on, o, grad, 1e-9, t); };
    {  // warm-up, untimed: threads start, and pages are first written. Two rounds: the
       // speculative engine's two copies of the moments alternate, and each one's pages fault
       // in the first step that writes it (0.3-0.45 s each at 100 M parameters).
      Times w;
      for (int r = 0; r < 2; ++r) run_off(w), run_kept(w), run_back(w);
    }
    for (int r = 0; r < o.rounds; ++r) {
      for (int k = 0; k < 3; ++k) switch ((r + k) % 3) {
          case 0:
            run_off(t_off);
            break;
          case 1:
            run_kept(t_kept);
            break;
          default:
            run_back(t_back);
        }
    }
    for (int r = 0; r < o.rounds; ++r) {
      kept_ratio.push_back(t_kept.wait[size_t(r)] / t_off.wait[size_t(r)]);
      back_ratio.push_back(t_back.wait[size_t(r)] / t_off.wait[size_t(r)]);
    }
  } else {
    // Each engine: two untimed rounds (the speculative one's alternate a kept and a rollback
    // step, so both copies of its moments have their pages), then `per` timed ones.
    const int per = o.rounds / o.phases;
    auto run_off = [&](Times& off) {
      std::unique_ptr<Engine> e = make_engine(o, false);
      Times w;
      for (int r = 0; r < 2 + per; ++r) train_step(*e, o, grad, 0, r < 2 ? w : off);
    };
    auto run_spec = [&](Times& kept, Times& back) {
      std::unique_ptr<Engine> e = make_engine(o, true);
      spec_cfg = e->config();
      Times w;
      for (int r = 0; r < 2 + per; ++r) {
        const bool kept_first = r % 2 == 0;
        train_step(*e, o, grad, kept_first ? 0 : 1e-9, r < 2 ? w : kept_first ? kept : back);
        train_step(*e, o, grad, kept_first ? 1e-9 : 0, r < 2 ? w : kept_first ? back : kept);
      }
    };
    for (int ph = 0; ph < o.phases; ++ph) {
      Times off, kept, back;
      if (ph % 2 == 0)  // which engine comes first alternates, as drift and the page faults of
        run_off(off), run_spec(kept, back);  // the engine freed before it would favour one
      else
        run_spec(kept, back), run_off(off);
      std::printf("phase %d: off %.3f s, kept %.3f s, rollback %.3f s (median waits)\n", ph,
                  median(off.wait), median(kept.wait), median(back.wait));
      kept_ratio.push_back(median(kept.wait) / median(off.wait));
      back_ratio.push_back(median(back.wait) / median(off.wait));
      append(t_off, off), append(t_kept, kept), append(t_back, back);
    }
    std::printf("\n");
  }
  const int units = int(o.n / o.unit);
  // On nvme a speculation the gradient cache could not wait for is dropped: counted below.
  if ((o.nvme.empty() && t_kept.kept != o.rounds * units) || t_back.dropped != o.rounds * units ||
      t_kept.kept + t_kept.dropped != o.rounds * units || t_back.kept != 0 ||
      t_off.kept + t_off.dropped != 0)
    usage("speculation was not kept (or dropped) where the benchmark expects it");
  // The planner's view of the same engine, at the update rate measured here.
  MachineRates rates;
  rates.update_params_per_s = double(o.n) / median(t_off.update);
  if (!o.nvme.empty()) {
    rates.nvme_step_params_per_s = rates.update_params_per_s;
    rates.update_params_per_s = cpu_update_rate(o, grad);
    std::printf("nvme step %.3g params/s, CPU update %.3g params/s (one unit in memory)\n\n",
                rates.nvme_step_params_per_s, rates.update_params_per_s);
  }
  rates.compute_s = 1.5 * median(t_kept.backward);
  std::vector<PlanUnit> units_plan;
  for (int u = 0; u < units; ++u)
    units_plan.push_back({"layer" + std::to_string(u), {Param{"w", {o.unit}}}});
  const StepPrediction p = predict_step(spec_cfg, units_plan, 1, rates);
  std::printf(
      "| step | backward s | wait in step() s | wait / off's | update in it s | predicted wait "
      "s |\n|---|---|---|---|---|---|\n");
  std::printf("| off | %s | %s | 1 | %.4f | %.4f |\n", range(t_off.backward).c_str(),
              range(t_off.wait).c_str(), median(t_off.update), p.rollback_s);
  std::printf("| kept | %s | %s | %s | %.4f | %.4f |\n", range(t_kept.backward).c_str(),
              range(t_kept.wait).c_str(), range(kept_ratio).c_str(), median(t_kept.update),
              o.nvme.empty() ? p.optimizer_s : p.nvme_s);
  std::printf("| rollback | %s | %s | %s | %.4f | %.4f |\n", range(t_back.backward).c_str(),
              range(t_back.wait).c_str(), range(back_ratio).c_str(), median(t_back.update),
              p.rollback_s);
  std::printf(
      "\nkept step: %d of %d speculations kept (the rest dropped for the gradient "
      "cache)\n",
      t_kept.kept, o.rounds * units);
  getloadavg(load, 3);
  std::printf("load average at the end: %.2f\n", load[0]);
  return 0;
}
