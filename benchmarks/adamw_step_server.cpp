// zeroshard's side of benchmarks/torch_adamw_bench.py. The script cannot call the kernel in its
// own process, so this program holds an AdamW state (f32 parameters and gradients; m and v in
// f32, or with --state 8bit as 8-bit codes in blocks of --block, Config::optimizer_state) and
// serves one command per stdin line:
//
//   step         run one fused AdamW step over all n parameters, print its seconds
//   load PATH    read n parameters then n gradients (raw little-endian f32) from PATH
//   dump PATH    write the n parameters to PATH
//   quit
//
// The step is the engine's: zeroshard::cpu::optimizer_update over 64 Ki-element chunks on a
// oneTBB arena, with the ISA chosen at run time. While the script times PyTorch this process
// waits on stdin, so the two never compete for the cores.
//
//   adamw_step_server --n N [--threads T] [--lr X] [--beta1 X] [--beta2 X] [--eps X] [--wd X]
//                     [--state f32|8bit] [--block B]

#include <tbb/global_control.h>
#include <tbb/info.h>
#include <tbb/task_arena.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <string>
#include <vector>

#include "benchmarks/bench_util.hpp"
#include "kernels/cpu/cpu_kernels.hpp"

namespace zc = zeroshard::cpu;

int main(int argc, char** argv) {
  int64_t n = 0;
  int threads = tbb::info::default_concurrency();
  bool q8 = false;
  int64_t block = 2048;
  zc::UpdateHyper h;
  h.kind = zeroshard::OptimizerKind::adamw;
  h.lr = 1e-3f, h.beta1 = 0.9f, h.beta2 = 0.999f, h.eps = 1e-8f, h.weight_decay = 0.01f;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i];
    const double v = std::atof(argv[i + 1]);
    if (a == "--n")
      n = std::atoll(argv[i + 1]);
    else if (a == "--threads")
      threads = int(v);
    else if (a == "--lr")
      h.lr = float(v);
    else if (a == "--beta1")
      h.beta1 = float(v);
    else if (a == "--beta2")
      h.beta2 = float(v);
    else if (a == "--eps")
      h.eps = float(v);
    else if (a == "--wd")
      h.weight_decay = float(v);
    else if (a == "--state" &&
             (std::string(argv[i + 1]) == "f32" || std::string(argv[i + 1]) == "8bit"))
      q8 = std::string(argv[i + 1]) == "8bit";
    else if (a == "--block")
      block = std::atoll(argv[i + 1]);
    else {
      std::fprintf(stderr, "adamw_step_server: unknown flag %s\n", a.c_str());
      return 2;
    }
  }
  constexpr int64_t kChunk = 1 << 16;
  if (n < 1 || threads < 1 || argc % 2 == 0 || block < 1 || block > zc::kMaxStateBlock ||
      kChunk % block != 0) {
    std::fprintf(
        stderr,
        "usage: adamw_step_server --n N [--threads T] [--lr X] [--beta1 X] [--beta2 X] "
        "[--eps X] [--wd X] [--state f32|8bit] [--block B dividing 65536, at most 4096]\n");
    return 2;
  }
  tbb::global_control limit(tbb::global_control::max_allowed_parallelism, size_t(threads));
  tbb::task_arena arena(threads);
  const zc::Isa isa = zc::best_isa();
  auto for_chunks = [&](auto body) { zs_bench::for_chunks(arena, n, kChunk, body); };
  const size_t count = static_cast<size_t>(n);
  // f32 moments, or 8-bit codes (all 0: zeros) and one absmax per block.
  std::vector<float> p(count), g(count), m(q8 ? 0 : count), v(q8 ? 0 : count);
  std::vector<uint8_t> m8(q8 ? count : 0), v8(q8 ? count : 0);
  std::vector<float> a0(q8 ? size_t((n + block - 1) / block) : 0), a1(a0.size());
  // Default contents (pages touched by the arena's threads, as the step will touch them).
  for_chunks([&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      p[size_t(i)] = float(i % 1000) * 1e-3f - 0.5f;
      g[size_t(i)] = float((i * 7) % 1000) * 1e-3f - 0.5f;
      if (q8)
        m8[size_t(i)] = v8[size_t(i)] = 0;
      else
        m[size_t(i)] = v[size_t(i)] = 0.0f;
    }
  });
  std::fprintf(stdout, "ready n=%lld threads=%d isa=%s state=%s\n", (long long)n, threads,
               zc::isa_name(isa), q8 ? "8bit" : "f32");
  std::fflush(stdout);

  int64_t step = 0;
  for (std::string line; std::getline(std::cin, line);) {
    if (line == "quit") break;
    if (line == "step") {
      ++step;
      h.bias_correction1 = float(1.0 - std::pow(double(h.beta1), double(step)));
      h.bias_correction2 = float(1.0 - std::pow(double(h.beta2), double(step)));
      const auto t0 = std::chrono::steady_clock::now();
      for_chunks([&](int64_t b, int64_t e) {
        zc::UpdateArgs a;
        a.master = p.data() + b;
        if (q8) {
          a.state0 = m8.data() + b, a.state1 = v8.data() + b;
          a.state_format = zeroshard::StateFormat::q8, a.block = block;
          a.absmax0 = a0.data() + b / block, a.absmax1 = a1.data() + b / block;
        } else {
          a.state0 = m.data() + b, a.state1 = v.data() + b;
        }
        a.grad = g.data() + b, a.grad_dtype = zeroshard::DType::f32, a.n = e - b;
        zc::optimizer_update(isa, h, a);
      });
      std::printf("%.9f\n",
                  std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    } else if (line.rfind("load ", 0) == 0 || line.rfind("dump ", 0) == 0) {
      const bool load = line[0] == 'l';
      std::FILE* f = std::fopen(line.substr(5).c_str(), load ? "rb" : "wb");
      bool ok = f != nullptr;
      if (ok && load)
        ok = std::fread(p.data(), 4, size_t(n), f) == size_t(n) &&
             std::fread(g.data(), 4, size_t(n), f) == size_t(n);
      if (ok && !load) ok = std::fwrite(p.data(), 4, size_t(n), f) == size_t(n);
      if (f) ok = std::fclose(f) == 0 && ok;
      std::printf(ok ? "ok\n" : "error: cannot %s %s\n", load ? "load" : "dump",
                  line.substr(5).c_str());
    } else {
      std::printf("error: unknown command '%s'\n", line.c_str());
    }
    std::fflush(stdout);
  }
  return 0;
}
