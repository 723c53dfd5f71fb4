// Capacity: trains (synthetic gradients, no model math) a stage-3 model whose fp32 optimizer
// state is many times the memory the engine is given, with optimizer state, master weights,
// gradients and parameters all on the nvme tier. Fails if the engine's ledger (host + device)
// ever exceeds --budget. Reports per step: forward and backward time (each gathers every unit
// from disk), step() time, bytes moved, and the process's peak resident memory (VmHWM).
// capacity_run.sh runs it inside a memory cgroup limited to the budget.
//
//   capacity_bench --dir DIR --params 1.5G --units 120 --steps 3 --budget 1.6G
//                  [--bs 1M] [--qd 16] [--buffers 3] [--state f32|bf16|8bit] [--master f32|bf16]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include "benchmarks/io/parse_size.hpp"
#include "zeroshard/zeroshard.hpp"

using namespace zeroshard;

namespace {

double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

using zeroshard::bench::parse_size;

// Peak resident set of this process, from the kernel (bytes).
int64_t peak_rss() {
  std::ifstream f("/proc/self/status");
  std::string line;
  while (std::getline(f, line))
    if (line.rfind("VmHWM:", 0) == 0) return std::atoll(line.c_str() + 6) * 1024;
  return -1;
}

double gib(int64_t b) {
  return double(b) / double(int64_t(1) << 30);
}

}  // namespace

int main(int argc, char** argv) {
  std::string dir;
  int64_t params = 1500000000, budget = int64_t(16) << 26, bs = 1 << 20;
  int units = 120, steps = 3, qd = 16, buffers = 3;
  StateFormat format = StateFormat::f32;
  bool bf16_master = false;
  for (int i = 1; i + 1 < argc; i += 2) {
    std::string k = argv[i], v = argv[i + 1];
    if (k == "--dir")
      dir = v;
    else if (k == "--params")
      params = parse_size(v, false);
    else if (k == "--units")
      units = std::atoi(v.c_str());
    else if (k == "--steps")
      steps = std::atoi(v.c_str());
    else if (k == "--budget")
      budget = parse_size(v, true);
    else if (k == "--bs")
      bs = parse_size(v, true);
    else if (k == "--qd")
      qd = std::atoi(v.c_str());
    else if (k == "--buffers")
      buffers = std::atoi(v.c_str());
    else if (k == "--state" && (v == "f32" || v == "bf16" || v == "8bit"))
      format = v == "f32" ? StateFormat::f32 : v == "bf16" ? StateFormat::bf16 : StateFormat::q8;
    else if (k == "--master" && (v == "f32" || v == "bf16"))
      bf16_master = v == "bf16";
    else {
      std::fprintf(stderr, "unknown option %s\n", k.c_str());
      return 2;
    }
  }
  if (dir.empty()) {
    std::fprintf(stderr,
                 "usage: capacity_bench --dir DIR [--params 1.5G] [--units 120] [--steps 3] "
                 "[--budget 1.6G] [--state f32|bf16|8bit] [--master f32|bf16]\n");
    return 2;
  }
  try {
    Config c;
    c.stage = 3;
    c.dtype = DType::bf16;
    c.optimizer.kind = OptimizerKind::adamw;
    c.optimizer_state = format;
    c.bf16_master = bf16_master;
    c.gradient_clipping = 1.0;
    c.offload_optimizer.tier = Tier::nvme;
    c.offload_optimizer.nvme_paths = {dir};
    c.offload_optimizer.buffer_count = buffers;
    c.offload_param.tier = Tier::nvme;
    c.offload_param.nvme_paths = {dir};
    c.offload_param.buffer_count = 3;
    c.aio.block_size = bs;
    c.aio.queue_depth = qd;
    Engine e(c, make_self_communicator());
    const int64_t per = params / units;
    for (int u = 0; u < units; ++u) e.add_unit("layer" + std::to_string(u), {Param{"w", {per}}});
    const double t0 = now();
    e.finalize();
    const double t_init = now() - t0;

    const MemoryReport m = e.memory();
    const int64_t held = m.total(Tier::host) + m.total(Tier::device);
    const int64_t state =
        m.at(Tier::nvme, MemKind::master) + m.at(Tier::nvme, MemKind::optim_state);
    std::printf(
        "capacity_bench: %lld parameters in %d units, stage 3, bf16, AdamW (%s moments, %s "
        "master), everything on nvme in %s\n",
        (long long)(per * units), units, state_format_name(format), bf16_master ? "bf16" : "f32",
        dir.c_str());
    std::printf(
        "%s master + optimizer state on nvme: %.2f GiB; swap files: %.2f GiB; memory budget %.2f "
        "GiB; "
        "engine memory (ledger): %.2f GiB; state / budget = %.1fx\n",
        bf16_master ? "bf16" : "f32", gib(state), gib(m.total(Tier::nvme)), gib(budget), gib(held),
        double(state) / double(budget));
    std::printf("finalize (create files, write initial state): %.1f s\n%s", t_init,
                m.to_string().c_str());
    if (held > budget) {
      std::fprintf(stderr, "capacity_bench: the engine holds %.2f GiB, above the %.2f GiB budget\n",
                   gib(held), gib(budget));
      return 1;
    }
    std::printf("%-5s %9s %9s %9s %10s %10s %9s %9s %10s\n", "step", "fwd_s", "bwd_s", "step_s",
                "read_GB", "written_GB", "wait_s", "norm", "peak_RSS");
    for (int s = 0; s < steps; ++s) {
      const SwapStats a = e.swap_stats();
      double t = now();
      for (int u = 0; u < units; ++u) {  // forward: every unit gathered (read from disk) once
        e.gather(u);
        e.release(u);
      }
      const double fwd = now() - t;
      t = now();
      for (int u = units - 1; u >= 0; --u) {  // backward: gathered again, gradients written
        e.gather(u);
        std::vector<TensorView> g = e.grads(u);
        uint16_t* p = g[0].as<uint16_t>();
        for (int64_t i = 0; i < g[0].numel; ++i)
          p[i] = uint16_t(0x3a00 + ((i * 7 + u + s) & 63));  // ~1e-3
        e.grads_ready(u);
        e.release(u);
      }
      const double bwd = now() - t;
      t = now();
      const StepResult r = e.step();
      const double st = now() - t;
      const SwapStats b = e.swap_stats();
      const MemoryReport mr = e.memory();
      const int64_t held_now = mr.total(Tier::host) + mr.total(Tier::device);
      int64_t peak = 0;
      for (int tier : {int(Tier::host), int(Tier::device)})
        for (int64_t p : mr.peak[size_t(tier)]) peak += p;
      std::printf("%-5d %9.2f %9.2f %9.2f %10.2f %10.2f %9.2f %9.4f %9.2fG\n", s, fwd, bwd, st,
                  double(b.bytes_read - a.bytes_read) / 1e9,
                  double(b.bytes_written - a.bytes_written) / 1e9, b.wait_s - a.wait_s, r.grad_norm,
                  gib(peak_rss()));
      std::fflush(stdout);
      if (held_now > budget || peak > budget) {
        std::fprintf(stderr,
                     "capacity_bench: the engine's memory (%.2f GiB, peak cells %.2f GiB) exceeded "
                     "the budget\n",
                     gib(held_now), gib(peak));
        return 1;
      }
    }
    std::printf("peak resident memory of the process (VmHWM): %.2f GiB\n", gib(peak_rss()));
  } catch (const Error& e) {
    std::fprintf(stderr, "capacity_bench: %s\n", e.what());
    return 1;
  }
  return 0;
}
