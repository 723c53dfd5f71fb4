// CPU optimizer step throughput against its memory-bandwidth ceiling (docs/DESIGN.md rule 9).
//
// For each optimizer and precision config, every round times one full update pass and one
// same-bytes pass (the same streams read and written, in place where the update is in place,
// no arithmetic) over N parameters, both split into fixed chunks run by tbb::parallel_for on the
// same arena with the same ISA. The order alternates per round so drift hits both equally; the
// figure of merit is the median over rounds of update throughput / same-bytes throughput.
//
//   cpu_optimizer_bench [--n 100000000] [--threads T] [--isa scalar|avx2|avx512]
//                       [--rounds 11] [--chunk 65536] [--formats]
//
// --formats: AdamW with its moments stored as bf16 and as 8-bit blocks instead, with an f32 and
// with a bf16 master (bf16 gradient in, bf16 copy out), each alternating with the f32-moment,
// f32-master update and with the same-bytes pass of its own streams.

#include <tbb/global_control.h>
#include <tbb/info.h>
#include <tbb/task_arena.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "benchmarks/bench_util.hpp"
#include "kernels/cpu/cpu_kernels.hpp"
#include "kernels/cpu/quant_code.hpp"

namespace zc = zeroshard::cpu;
using zeroshard::DType;
using zeroshard::OptimizerKind;
using zs_bench::Buffer;
using zs_bench::hashed;
using zs_bench::median;
using zs_bench::seconds_since;

namespace {

struct Options {
  int64_t n = 100000000;
  int threads = 0;
  zc::Isa isa = zc::best_isa();
  int rounds = 11;
  int64_t chunk = 65536;
  bool formats = false;  // --formats: the moment formats' table instead of the optimizers'
};

[[noreturn]] void usage(const char* why) {
  std::fprintf(stderr,
               "%s\nusage: cpu_optimizer_bench [--n N] [--threads T] [--isa scalar|avx2|avx512] "
               "[--rounds R>=7] [--chunk C] [--formats]\n",
               why);
  std::exit(2);
}

// Flags take a value each; the chunk must be even so config (b)'s half-width streams split into
// whole floats.
Options parse(int argc, char** argv) {
  Options o;
  o.threads = tbb::info::default_concurrency();
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--formats") {
      o.formats = true;
      continue;
    }
    if (i + 1 >= argc) usage(("missing value after " + arg).c_str());
    const char* val = argv[++i];
    if (arg == "--n") {
      o.n = std::atoll(val);
    } else if (arg == "--threads") {
      o.threads = std::atoi(val);
    } else if (arg == "--rounds") {
      o.rounds = std::atoi(val);
    } else if (arg == "--chunk") {
      o.chunk = std::atoll(val);
    } else if (arg == "--isa") {
      bool found = false;
      for (zc::Isa isa : {zc::Isa::scalar, zc::Isa::avx2, zc::Isa::avx512}) {
        if (std::strcmp(val, zc::isa_name(isa)) == 0) o.isa = isa, found = true;
      }
      if (!found) usage("unknown --isa");
      if (!zc::isa_supported(o.isa)) usage("this CPU does not support that --isa");
    } else {
      usage(("unknown flag " + arg).c_str());
    }
  }
  if (o.n < 1 || o.threads < 1 || o.chunk < 2 || o.chunk % 2 != 0)
    usage("bad --n/--threads/--chunk");
  if (o.rounds < 7) usage("--rounds must be at least 7 (rule 9)");
  return o;
}

// One side's arrays: master, two states and the bf16 copy-out. The update and the same-bytes
// kernel each own a set (same-bytes writes bit patterns no optimizer should read back); the
// gradients are read-only and shared.
struct Side {
  float *p, *m, *v;
  uint16_t* out;
};

struct Case {
  const char* name;
  OptimizerKind kind;
  float momentum;
  int states;  // f32 state arrays besides the master: adam 2, lion 1, sgd(momentum) 1
};

struct Row {
  double bytes_per_param, update_rate, same_rate, ratio_median, ratio_min, ratio_max;
};

class Bench {
 public:
  explicit Bench(const Options& o)
      : o_(o),
        arena_(o.threads),
        f32_(static_cast<size_t>(o.n) * 4),
        f16_(static_cast<size_t>(o.n) * 2),
        up_p_(f32_),
        up_m_(f32_),
        up_v_(f32_),
        up_out_(f16_),
        sb_p_(f32_),
        sb_m_(f32_),
        sb_v_(f32_),
        sb_out_(f16_),
        g32_(f32_),
        g16_(f16_) {
    const int64_t n = o.n;
    // Written by the same chunked threads that later run the kernels: pre-faults every page
    // (no first-touch faults inside a timed pass) and places pages where they will be used.
    for_chunks([&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) {
        const float g = hashed(i, -1.0f, 1.0f);
        g32_.f32()[i] = g;
        g16_.u16()[i] = zc::float_to_bf16(g);
        up_p_.f32()[i] = sb_p_.f32()[i] = hashed(i + n, -0.5f, 0.5f);
        up_m_.f32()[i] = up_v_.f32()[i] = sb_m_.f32()[i] = sb_v_.f32()[i] = 0.0f;
        up_out_.u16()[i] = sb_out_.u16()[i] = 0;
      }
    });
  }

  // Config (a) (low = false): f32 grads, no copy-out. Config (b): bf16 grads, bf16 copy-out.
  Row run(const Case& c, bool low) {
    zc::UpdateHyper h;
    h.kind = c.kind;
    h.lr = c.kind == OptimizerKind::sgd ? 1e-3f : 1e-4f;
    h.beta1 = 0.9f;
    h.beta2 = c.kind == OptimizerKind::lion ? 0.99f : 0.999f;
    h.eps = 1e-8f;
    h.weight_decay = 0.01f;
    h.momentum = c.momentum;
    const Side up{up_p_.f32(), up_m_.f32(), up_v_.f32(), up_out_.u16()};
    const Side sb{sb_p_.f32(), sb_m_.f32(), sb_v_.f32(), sb_out_.u16()};

    auto update = [&](int64_t b, int64_t e) {
      zc::UpdateArgs a;
      a.master = up.p + b;
      a.state0 = up.m + b;
      a.state1 = c.states == 2 ? up.v + b : nullptr;
      a.grad =
          low ? static_cast<const void*>(g16_.u16() + b) : static_cast<const void*>(g32_.f32() + b);
      a.grad_dtype = low ? DType::bf16 : DType::f32;
      a.out = low ? up.out + b : nullptr;
      a.out_dtype = DType::bf16;
      a.n = e - b;
      zc::optimizer_update(o_.isa, h, a);
    };
    // The update's streams: master and states read and written in place, the grad read. In
    // config (b) the bf16 grad and the bf16 copy-out are half-width streams, moved as
    // (e - b) / 2 floats by a second call on the same chunk (so chunks must be even-sized).
    auto same = [&](int64_t b, int64_t e) {
      const int arrays = 1 + c.states;
      float* rw[3] = {sb.p + b, sb.m + b, sb.v + b};
      const float* rd[4] = {sb.p + b, sb.m + b, sb.v + b, nullptr};
      if (!low) {
        rd[arrays] = g32_.f32() + b;
        zc::same_bytes(o_.isa, rd, arrays + 1, rw, arrays, e - b);
        return;
      }
      zc::same_bytes(o_.isa, rd, arrays, rw, arrays, e - b);
      const float* g_half = reinterpret_cast<const float*>(g16_.u16() + b);
      float* out_half = reinterpret_cast<float*>(sb.out + b);
      zc::same_bytes(o_.isa, &g_half, 1, &out_half, 1, (e - b) / 2);
    };

    int step = 0;
    auto time_update = [&] {
      ++step;  // bias corrections of step t, folded in double as the engine does
      h.bias_correction1 = static_cast<float>(1.0 - std::pow(0.9, step));
      h.bias_correction2 = static_cast<float>(1.0 - std::pow(double{h.beta2}, step));
      const auto t0 = std::chrono::steady_clock::now();
      for_chunks(update);
      return seconds_since(t0);
    };
    auto time_same = [&] {
      const auto t0 = std::chrono::steady_clock::now();
      for_chunks(same);
      return seconds_since(t0);
    };
    time_update();  // warm-up of both, untimed: thread start, page-table and THP settling
    time_same();
    std::vector<double> t_up, t_sb, ratio;
    for (int r = 0; r < o_.rounds; ++r) {
      // Alternate which kernel goes first, so a trend within a round favours neither.
      const bool update_first = r % 2 == 0;
      const double first = update_first ? time_update() : time_same();
      const double second = update_first ? time_same() : time_update();
      t_up.push_back(update_first ? first : second);
      t_sb.push_back(update_first ? second : first);
      ratio.push_back(t_sb.back() / t_up.back());
    }
    Row row;
    row.bytes_per_param = (1 + c.states) * 8.0 + (low ? 2.0 + 2.0 : 4.0);  // arrays r+w, grad, out
    row.update_rate = static_cast<double>(o_.n) / median(t_up);
    row.same_rate = static_cast<double>(o_.n) / median(t_sb);
    row.ratio_median = median(ratio);
    row.ratio_min = *std::min_element(ratio.begin(), ratio.end());
    row.ratio_max = *std::max_element(ratio.begin(), ratio.end());
    return row;
  }

  // AdamW, bf16 gradient in and bf16 copy out, with the moments stored as `f` (q8 in blocks of
  // `block`) and the master as `master` (f32, or bf16 rounded stochastically), against the
  // f32-moment, f32-master update and against the same-bytes pass of this format's own
  // streams, all three alternating round by round. Returns the rate and the two ratios.
  struct FormatRow {
    double rate, vs_f32_median, vs_f32_min, vs_f32_max, vs_same_median, bytes_per_param;
  };
  FormatRow run_format(zeroshard::StateFormat f, int64_t block, DType master) {
    zc::UpdateHyper h;
    h.kind = OptimizerKind::adamw;
    h.lr = 1e-4f;
    h.beta1 = 0.9f;
    h.beta2 = 0.999f;
    h.eps = 1e-8f;
    h.weight_decay = 0.01f;
    const int64_t n = o_.n;
    // The compact moments live in the f32 update's m and v arrays' memory of the same-bytes
    // side (sb_*), which is large enough; their absmax arrays are separate.
    const size_t blocks = size_t((n + block - 1) / block) + 1;
    std::vector<float> a0(blocks, 0.0f), a1(blocks, 0.0f);
    auto* m8 = reinterpret_cast<unsigned char*>(sb_m_.f32());
    auto* v8 = reinterpret_cast<unsigned char*>(sb_v_.f32());
    const size_t sb = zc::state_bytes(f);
    const size_t mb = master == DType::f32 ? 4 : 2;
    if (master == DType::bf16) {  // a bf16 master in sb_p_'s memory, from the f32 values there
      for_chunks([&](int64_t b, int64_t e) {
        std::vector<uint16_t> w(size_t(e - b));
        zc::convert(o_.isa, sb_p_.f32() + b, DType::f32, w.data(), DType::bf16, e - b);
        std::memcpy(sb_p_.u16() + b, w.data(), w.size() * 2);
      });
    }
    for_chunks([&](int64_t b, int64_t e) {
      std::memset(m8 + size_t(b) * sb, 0, size_t(e - b) * sb);
      std::memset(v8 + size_t(b) * sb, 0, size_t(e - b) * sb);
    });
    if (f == zeroshard::StateFormat::q8) {  // zero moments: the code's zero point, absmax 0
      for_chunks([&](int64_t b, int64_t e) {
        std::memset(m8 + b, zc::kQ8Zero, size_t(e - b));
        std::memset(v8 + b, zc::kQ8Zero, size_t(e - b));
      });
    }
    auto args = [&](void* p, DType pd, void* m, void* v, zeroshard::StateFormat sf, int64_t b,
                    int64_t e) {
      zc::UpdateArgs a;
      a.master = static_cast<char*>(p) + size_t(b) * (pd == DType::f32 ? 4 : 2);
      a.master_dtype = pd;
      a.index = b;
      a.state0 = static_cast<char*>(m) + size_t(b) * zc::state_bytes(sf);
      a.state1 = static_cast<char*>(v) + size_t(b) * zc::state_bytes(sf);
      a.state_format = sf;
      a.absmax0 = a0.data() + b / block;
      a.absmax1 = a1.data() + b / block;
      a.block = block;
      a.grad = g16_.u16() + b;
      a.grad_dtype = DType::bf16;
      a.out = up_out_.u16() + b;
      a.out_dtype = DType::bf16;
      a.n = e - b;
      return a;
    };
    int step = 0;
    auto fold = [&] {
      ++step;
      h.bias_correction1 = static_cast<float>(1.0 - std::pow(0.9, step));
      h.bias_correction2 = static_cast<float>(1.0 - std::pow(0.999, step));
    };
    auto time_f32 = [&] {
      fold();
      const auto t0 = std::chrono::steady_clock::now();
      for_chunks([&](int64_t b, int64_t e) {
        zc::optimizer_update(o_.isa, h,
                             args(up_p_.f32(), DType::f32, up_m_.f32(), up_v_.f32(),
                                  zeroshard::StateFormat::f32, b, e));
      });
      return seconds_since(t0);
    };
    auto time_fmt = [&] {
      const auto t0 = std::chrono::steady_clock::now();
      for_chunks([&](int64_t b, int64_t e) {
        zc::optimizer_update(o_.isa, h, args(sb_p_.f32(), master, m8, v8, f, b, e));
      });
      return seconds_since(t0);
    };
    // Same bytes: master r+w and both moments r+w at their width, bf16 grad in, bf16 copy out
    // (moved as floats over the byte count; chunks are multiples of 8 elements).
    auto time_same = [&] {
      const auto t0 = std::chrono::steady_clock::now();
      for_chunks([&](int64_t b, int64_t e) {
        float* p = reinterpret_cast<float*>(reinterpret_cast<char*>(sb_p_.f32()) + size_t(b) * mb);
        const float* rp = p;
        zc::same_bytes(o_.isa, &rp, 1, &p, 1, (e - b) * int64_t(mb) / 4);
        const int64_t words = (e - b) * int64_t(sb) / 4;
        float* m = reinterpret_cast<float*>(m8 + size_t(b) * sb);
        float* v = reinterpret_cast<float*>(v8 + size_t(b) * sb);
        const float* rd[2] = {m, v};
        float* wr[2] = {m, v};
        zc::same_bytes(o_.isa, rd, 2, wr, 2, words);
        const float* g = reinterpret_cast<const float*>(g16_.u16() + b);
        float* out = reinterpret_cast<float*>(sb_out_.u16() + b);
        zc::same_bytes(o_.isa, &g, 1, &out, 1, (e - b) / 2);
      });
      return seconds_since(t0);
    };
    time_f32();
    time_fmt();
    time_same();
    std::vector<double> t_fmt, vs32, vssame;
    for (int r = 0; r < o_.rounds; ++r) {
      double t32, tf, ts;
      if (r % 2 == 0) {
        t32 = time_f32(), tf = time_fmt(), ts = time_same();
      } else {
        ts = time_same(), tf = time_fmt(), t32 = time_f32();
      }
      t_fmt.push_back(tf);
      vs32.push_back(t32 / tf);
      vssame.push_back(ts / tf);
    }
    FormatRow row;
    row.rate = double(n) / median(t_fmt);
    row.vs_f32_median = median(vs32);
    row.vs_f32_min = *std::min_element(vs32.begin(), vs32.end());
    row.vs_f32_max = *std::max_element(vs32.begin(), vs32.end());
    row.vs_same_median = median(vssame);
    row.bytes_per_param = 2.0 * double(mb) + 2.0 * 2 * double(sb) + 4 +
                          (f == zeroshard::StateFormat::q8 ? 2 * 2 * 4.0 / double(block) : 0);
    return row;
  }

 private:
  // Runs body(begin, end) over [0, n) in fixed chunks on the arena: the engine's scheme, and
  // the same for both kernels.
  template <class Body>
  void for_chunks(const Body& body) {
    zs_bench::for_chunks(arena_, o_.n, o_.chunk, body);
  }

  Options o_;
  tbb::task_arena arena_;
  size_t f32_, f16_;
  Buffer up_p_, up_m_, up_v_, up_out_;
  Buffer sb_p_, sb_m_, sb_v_, sb_out_;
  Buffer g32_, g16_;
};

}  // namespace

int main(int argc, char** argv) {
  const Options o = parse(argc, argv);
  // Caps TBB's worker pool too, so --threads really is the number of threads touching memory.
  tbb::global_control limit(tbb::global_control::max_allowed_parallelism,
                            static_cast<size_t>(o.threads));
  Bench bench(o);
  const Case cases[] = {{"adam", OptimizerKind::adam, 0.0f, 2},
                        {"adamw", OptimizerKind::adamw, 0.0f, 2},
                        {"lion", OptimizerKind::lion, 0.0f, 1},
                        {"sgd (momentum 0.9)", OptimizerKind::sgd, 0.9f, 1}};

  std::printf("cpu_optimizer_bench: n=%lld threads=%d isa=%s rounds=%d chunk=%lld\n\n",
              static_cast<long long>(o.n), o.threads, zc::isa_name(o.isa), o.rounds,
              static_cast<long long>(o.chunk));
  if (o.formats) {
    std::printf(
        "| moments | master | bytes/param | update Gparam/s | vs f32 moments median (min–max) | "
        "vs same-bytes median |\n|---|---|---|---|---|---|\n");
    struct F {
      const char* name;
      zeroshard::StateFormat f;
      int64_t block;
      DType master;
    };
    // The bf16-master rows come last: they overwrite the f32 master with its bf16 rounding.
    for (const F& f : {F{"bf16", zeroshard::StateFormat::bf16, 2048, DType::f32},
                       F{"8bit, block 2048", zeroshard::StateFormat::q8, 2048, DType::f32},
                       F{"8bit, block 256", zeroshard::StateFormat::q8, 256, DType::f32},
                       F{"bf16", zeroshard::StateFormat::bf16, 2048, DType::bf16},
                       F{"8bit, block 2048", zeroshard::StateFormat::q8, 2048, DType::bf16}}) {
      const auto r = bench.run_format(f.f, f.block, f.master);
      std::printf("| %s | %s | %.2f | %.3f | %.3f (%.3f–%.3f) | %.3f |\n", f.name,
                  f.master == DType::f32 ? "f32" : "bf16", r.bytes_per_param, r.rate / 1e9,
                  r.vs_f32_median, r.vs_f32_min, r.vs_f32_max, r.vs_same_median);
      std::fflush(stdout);
    }
    return 0;
  }
  std::printf(
      "| optimizer | config | bytes/param | update Gparam/s | same-bytes Gparam/s | "
      "update GB/s | ratio median (min–max) |\n");
  std::printf("|---|---|---|---|---|---|---|\n");
  for (const Case& c : cases) {
    for (bool low : {false, true}) {
      const Row r = bench.run(c, low);
      std::printf("| %s | %s | %.0f | %.3f | %.3f | %.1f | %.3f (%.3f–%.3f) |\n", c.name,
                  low ? "(b) bf16 grad + bf16 out" : "(a) f32 grad", r.bytes_per_param,
                  r.update_rate / 1e9, r.same_rate / 1e9, r.update_rate * r.bytes_per_param / 1e9,
                  r.ratio_median, r.ratio_min, r.ratio_max);
      std::fflush(stdout);  // rows appear as they finish; a full run takes minutes
    }
  }
  return 0;
}
