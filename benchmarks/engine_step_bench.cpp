// Engine::step() on the host tier against the memory ceiling of its own bytes, and the CPU time
// of the whole training step around it (docs/DESIGN.md rule 9: ratios measured in one process).
//
// A world-1 engine (self communicator, CPU device, stage 2, AdamW state on the host tier, no
// clipping) holds N parameters in units of U. Every round runs these, in an order that rotates
// round by round so drift hits all alike:
//   kernel  the fused update alone (cpu::optimizer_update in 64 Ki-element chunks on a oneTBB
//           arena) over arrays of its own, with exactly the streams the step moves;
//   same    a same-bytes pass over those streams: read and written, no arithmetic;
//   step    the trainer's hand-over of every unit's gradient (the copying grads_ready(), the
//           Python optimizer's path), then Engine::step(); each timed on the wall clock and in
//           process CPU seconds (every thread), so work moved out of step() still shows.
// Streams: (a) f32 model: master, m, v read and written, f32 gradient read, f32 parameters
// written (the state is on the host tier, the parameters on the device tier: 32 B/param);
// (b) bf16 model: the same with a bf16 gradient in and a bf16 parameter copy out (28 B/param).
//
//   engine_step_bench [--n 100000000] [--unit 4000000] [--threads 2] [--rounds 21]

#include <tbb/global_control.h>
#include <tbb/task_arena.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "benchmarks/bench_util.hpp"
#include "kernels/cpu/cpu_kernels.hpp"
#include "zeroshard/zeroshard.hpp"

namespace zc = zeroshard::cpu;
using namespace zeroshard;
using zs_bench::Buffer;
using zs_bench::median;

namespace {

struct Options {
  int64_t n = 100000000;
  int64_t unit = 4000000;
  int threads = 2;
  int rounds = 21;
};

[[noreturn]] void usage(const std::string& why) {
  std::fprintf(stderr,
               "%s\nusage: engine_step_bench [--n N] [--unit U] [--threads T] [--rounds R>=7]\n",
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
    else if (arg == "--threads")
      o.threads = std::atoi(val);
    else if (arg == "--rounds")
      o.rounds = std::atoi(val);
    else
      usage("unknown flag " + arg);
  }
  if (o.unit < 2 || o.unit % 2 != 0 || o.n < o.unit || o.n % o.unit != 0)
    usage("--unit must be even and divide --n");
  if (o.threads < 1) usage("bad --threads");
  if (o.rounds < 7) usage("--rounds must be at least 7 (rule 9)");
  return o;
}

constexpr int64_t kChunk = 65536;  // the engine's chunk (cpu::Arena::kChunk)

zc::UpdateHyper adamw_hyper() {
  zc::UpdateHyper h;
  h.kind = OptimizerKind::adamw;
  h.lr = 1e-4f;
  h.beta1 = 0.9f;
  h.beta2 = 0.999f;
  h.eps = 1e-8f;
  h.weight_decay = 0.01f;
  return h;
}

struct Series {
  std::vector<double> kernel, same, handover, step, update, handover_cpu, step_cpu;
  std::vector<double> same_over_kernel, same_over_step;
};

class Bench {
 public:
  Bench(const Options& o, DType dt)
      : o_(o),
        dt_(dt),
        arena_(o.threads),
        out_bytes_(dtype_size(dt)),
        p_(size_t(o.n) * 4),
        m_(size_t(o.n) * 4),
        v_(size_t(o.n) * 4),
        out_(size_t(o.n) * out_bytes_),
        sp_(size_t(o.n) * 4),
        sm_(size_t(o.n) * 4),
        sv_(size_t(o.n) * 4),
        sout_(size_t(o.n) * out_bytes_),
        g_(size_t(o.n) * dtype_size(dt)) {
    // Written by the chunked threads that later run the kernels: every page is faulted in
    // before a timed pass.
    for_chunks([&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) {
        const float g = zs_bench::hashed(i, -1.0f, 1.0f);
        if (dt_ == DType::f32)
          g_.f32()[i] = g;
        else
          g_.u16()[i] = zc::float_to_bf16(g);
        p_.f32()[i] = sp_.f32()[i] = zs_bench::hashed(i + o_.n, -0.5f, 0.5f);
        m_.f32()[i] = v_.f32()[i] = sm_.f32()[i] = sv_.f32()[i] = 0.0f;
      }
      std::memset(out_.mem.get() + size_t(b) * out_bytes_, 0, size_t(e - b) * out_bytes_);
      std::memset(sout_.mem.get() + size_t(b) * out_bytes_, 0, size_t(e - b) * out_bytes_);
    });
    make_engine();
  }

  double bytes_per_param() const { return 24.0 + 2.0 * double(dtype_size(dt_)); }

  Series run() {
    Series s;
    auto kernel = [&] { s.kernel.push_back(time_kernel()); };
    auto same = [&] { s.same.push_back(time_same()); };
    auto step = [&] { time_step(s); };
    const std::vector<std::function<void()>> parts = {kernel, same, step};
    kernel(), same(), step();  // warm-up, untimed: thread start, first steps' page settling
    s = Series{};
    for (int r = 0; r < o_.rounds; ++r) {
      for (size_t k = 0; k < parts.size(); ++k) parts[(size_t(r) + k) % parts.size()]();
      s.same_over_kernel.push_back(s.same.back() / s.kernel.back());
      s.same_over_step.push_back(s.same.back() / s.step.back());
    }
    return s;
  }

 private:
  template <class Body>
  void for_chunks(const Body& body) {
    zs_bench::for_chunks(arena_, o_.n, kChunk, body);
  }

  void make_engine() {
    Config cfg;
    cfg.stage = 2;
    cfg.dtype = dt_;
    cfg.offload_optimizer.tier = Tier::host;
    cfg.optimizer.kind = OptimizerKind::adamw;
    const zc::UpdateHyper h = adamw_hyper();
    cfg.optimizer.lr = h.lr;
    cfg.optimizer.weight_decay = h.weight_decay;
    engine_ = std::make_unique<Engine>(cfg, make_self_communicator());
    for (int64_t u = 0; u < o_.n / o_.unit; ++u)
      engine_->add_unit("layer" + std::to_string(u), {Param{"w", {o_.unit}}});
    engine_->finalize();
  }

  double time_kernel() {
    zc::UpdateHyper h = adamw_hyper();
    ++kernel_steps_;
    h.bias_correction1 = float(1.0 - std::pow(0.9, double(kernel_steps_)));
    h.bias_correction2 = float(1.0 - std::pow(0.999, double(kernel_steps_)));
    const auto t0 = std::chrono::steady_clock::now();
    for_chunks([&](int64_t b, int64_t e) {
      zc::UpdateArgs a;
      a.master = p_.f32() + b;
      a.state0 = m_.f32() + b;
      a.state1 = v_.f32() + b;
      a.grad = g_.mem.get() + size_t(b) * dtype_size(dt_);
      a.grad_dtype = dt_;
      a.out = out_.mem.get() + size_t(b) * out_bytes_;
      a.out_dtype = dt_;
      a.n = e - b;
      zc::optimizer_update(arena_isa_, h, a);
    });
    return zs_bench::seconds_since(t0);
  }

  // The step's streams without arithmetic. bf16 streams are moved as half as many floats by a
  // second call on the same chunk (chunks are even-sized).
  double time_same() {
    const auto t0 = std::chrono::steady_clock::now();
    for_chunks([&](int64_t b, int64_t e) {
      float* w[4] = {sp_.f32() + b, sm_.f32() + b, sv_.f32() + b, nullptr};
      const float* r[4] = {sp_.f32() + b, sm_.f32() + b, sv_.f32() + b, nullptr};
      if (dt_ == DType::f32) {
        r[3] = g_.f32() + b;
        w[3] = sout_.f32() + b;
        zc::same_bytes(arena_isa_, r, 4, w, 4, e - b);
        return;
      }
      zc::same_bytes(arena_isa_, r, 3, w, 3, e - b);
      const float* g_half = reinterpret_cast<const float*>(g_.u16() + b);
      float* out_half = reinterpret_cast<float*>(sout_.u16() + b);
      zc::same_bytes(arena_isa_, &g_half, 1, &out_half, 1, (e - b) / 2);
    });
    return zs_bench::seconds_since(t0);
  }

  // The gradients go over from the last unit to the first, as a backward pass hands them.
  void time_step(Series& s) {
    const size_t gb = dtype_size(dt_);
    double c0 = zs_bench::process_cpu_s();
    auto t0 = std::chrono::steady_clock::now();
    for (int64_t u = o_.n / o_.unit - 1; u >= 0; --u) {
      TensorView g;
      g.data = g_.mem.get() + size_t(u * o_.unit) * gb;
      g.numel = o_.unit;
      g.dtype = dt_;
      engine_->grads_ready(int(u), {g});
    }
    s.handover.push_back(zs_bench::seconds_since(t0));
    s.handover_cpu.push_back(zs_bench::process_cpu_s() - c0);
    c0 = zs_bench::process_cpu_s();
    t0 = std::chrono::steady_clock::now();
    const StepResult r = engine_->step();
    s.step.push_back(zs_bench::seconds_since(t0));
    s.step_cpu.push_back(zs_bench::process_cpu_s() - c0);
    s.update.push_back(r.optimizer_s);
    if (r.skipped) usage("the engine skipped a step: the benchmark's gradients overflowed");
  }

  Options o_;
  DType dt_;
  tbb::task_arena arena_;
  zc::Isa arena_isa_ = zc::best_isa();
  size_t out_bytes_;
  Buffer p_, m_, v_, out_;      // the kernel's arrays
  Buffer sp_, sm_, sv_, sout_;  // the same-bytes pass's (it writes bit patterns, not values)
  Buffer g_;                    // the gradient: read by all three
  std::unique_ptr<Engine> engine_;
  int64_t kernel_steps_ = 0;
};

std::string ratio(const std::vector<double>& v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.3f (%.3f–%.3f)", median(v),
                *std::min_element(v.begin(), v.end()), *std::max_element(v.begin(), v.end()));
  return buf;
}

}  // namespace

int main(int argc, char** argv) {
  const Options o = parse(argc, argv);
  // The engine's arena takes its thread count from here; TBB's pool is capped to the same.
  setenv("ZEROSHARD_CPU_THREADS", std::to_string(o.threads).c_str(), 1);
  tbb::global_control limit(tbb::global_control::max_allowed_parallelism, size_t(o.threads));
  double load[3] = {0, 0, 0};
  getloadavg(load, 3);
  std::printf(
      "engine_step_bench: n=%lld unit=%lld threads=%d isa=%s rounds=%d, load average %.2f\n\n",
      (long long)o.n, (long long)o.unit, o.threads, zc::isa_name(zc::best_isa()), o.rounds,
      load[0]);
  std::printf(
      "| model | bytes/param | step Gparam/s | step / same-bytes | kernel / same-bytes | "
      "update in step s | rest of step s | hand-over s | CPU s: hand-over + step | same-bytes s "
      "|\n");
  std::printf("|---|---|---|---|---|---|---|---|---|---|\n");
  for (DType dt : {DType::f32, DType::bf16}) {
    Series s;
    double bpp = 0;
    {
      Bench bench(o, dt);
      bpp = bench.bytes_per_param();
      s = bench.run();
    }
    std::vector<double> rest;
    for (size_t i = 0; i < s.step.size(); ++i) rest.push_back(s.step[i] - s.update[i]);
    std::vector<double> cpu;
    for (size_t i = 0; i < s.step.size(); ++i) cpu.push_back(s.handover_cpu[i] + s.step_cpu[i]);
    std::printf("| %s | %.0f | %.3f | %s | %s | %.3f | %.3f | %.3f | %.3f | %.3f |\n",
                dtype_name(dt), bpp, double(o.n) / median(s.step) / 1e9,
                ratio(s.same_over_step).c_str(), ratio(s.same_over_kernel).c_str(),
                median(s.update), median(rest), median(s.handover), median(cpu), median(s.same));
    std::fflush(stdout);
  }
  getloadavg(load, 3);
  std::printf("\nload average at the end: %.2f\n", load[0]);
  return 0;
}
