// CPU kernels: every ISA bitwise equal to the scalar reference (cpu_kernels.hpp's contract), the
// scalar update against an independent double-precision evaluation of the formulas, and the
// conversions against hand-checked bit patterns and the compiler's own _Float16.

#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "kernels/cpu/cpu_kernels.hpp"
#include "zeroshard/error.hpp"

namespace zeroshard::cpu {
namespace {

constexpr int64_t kLengths[] = {0, 1, 7, 15, 16, 17, 63, 64, 65, 1000, 4099};
constexpr DType kDTypes[] = {DType::f32, DType::bf16, DType::f16};

size_t dsize(DType d) {
  return d == DType::f32 ? 4 : 2;
}
const char* dname(DType d) {
  return d == DType::f32 ? "f32" : d == DType::bf16 ? "bf16" : "f16";
}
uint32_t bits(float f) {
  return std::bit_cast<uint32_t>(f);
}
float from_bits(uint32_t u) {
  return std::bit_cast<float>(u);
}

// A typed buffer held as bytes, so one container serves f32, bf16 and f16.
struct Buf {
  DType dtype = DType::f32;
  std::vector<unsigned char> bytes;
  Buf(DType d, int64_t n) : dtype(d), bytes(static_cast<size_t>(n) * dsize(d), 0) {}
  void* data() { return bytes.data(); }
  void set(int64_t i, float v) {
    if (dtype == DType::f32) {
      std::memcpy(&bytes[i * 4], &v, 4);
    } else {
      const uint16_t h = dtype == DType::bf16 ? float_to_bf16(v) : float_to_f16(v);
      std::memcpy(&bytes[i * 2], &h, 2);
    }
  }
  float get(int64_t i) const {
    if (dtype == DType::f32) {
      float v;
      std::memcpy(&v, &bytes[i * 4], 4);
      return v;
    }
    uint16_t h;
    std::memcpy(&h, &bytes[i * 2], 2);
    return dtype == DType::bf16 ? bf16_to_float(h) : f16_to_float(h);
  }
};

// Awkward values placed among the random ones: signed zeros, a subnormal, values that overflow
// f16 or round at bf16 ties, inf and NaN. Bitwise equality must hold for them too.
constexpr uint32_t kSpecials[] = {0x00000000u, 0x80000000u, 0x00000001u, 0x477FF000u,
                                  0x3F808000u, 0x7F800000u, 0xFF800000u, 0x7FC00000u};

std::vector<float> random_floats(std::mt19937& rng, int64_t n, float lo, float hi, bool specials) {
  std::uniform_real_distribution<float> dist(lo, hi);
  std::vector<float> v(static_cast<size_t>(n));
  for (auto& x : v) x = dist(rng);
  if (specials) {
    for (int64_t i = 5; i < n; i += 11) v[i] = from_bits(kSpecials[(i / 11) % 8]);
  }
  return v;
}

struct OptimizerCase {
  std::string name;
  UpdateHyper hyper;
};

// Adam/AdamW at step 1 (bias corrections far from 1), SGD in all three shapes, Lion; a grad
// scale that is not a power of two so the scaling multiply really rounds.
std::vector<OptimizerCase> optimizer_cases() {
  UpdateHyper base;
  base.lr = 1e-3f;
  base.beta1 = 0.9f;
  base.beta2 = 0.999f;
  base.eps = 1e-8f;
  base.bias_correction1 = 0.1f;
  base.bias_correction2 = 0.001f;
  base.grad_scale = 1.0f / 3.0f;
  std::vector<OptimizerCase> cases;
  UpdateHyper h = base;
  h.kind = OptimizerKind::adam;
  h.weight_decay = 0.01f;
  cases.push_back({"adam", h});
  h.kind = OptimizerKind::adamw;
  h.weight_decay = 0.1f;
  cases.push_back({"adamw", h});
  h = base;
  h.kind = OptimizerKind::sgd;
  h.lr = 0.05f;
  h.weight_decay = 1e-4f;
  cases.push_back({"sgd", h});
  h.momentum = 0.9f;
  cases.push_back({"sgd_momentum", h});
  h.nesterov = true;
  cases.push_back({"sgd_nesterov", h});
  h = base;
  h.kind = OptimizerKind::lion;
  h.lr = 1e-4f;
  h.beta2 = 0.99f;
  h.weight_decay = 0.1f;
  cases.push_back({"lion", h});
  h = base;
  h.kind = OptimizerKind::muon;
  h.lr = 2e-2f;
  h.momentum = 0.95f;
  h.nesterov = true;
  h.weight_decay = 0.1f;
  cases.push_back({"muon", h});
  return cases;
}

// The arrays one update works on, filled from a seed; with_out = false passes out = nullptr.
struct UpdateState {
  std::vector<float> master, s0, s1;
  std::vector<float> dir;  // Muon's direction (the kernel reads it for muon only)
  Buf grad;
  bool has_out;
  Buf out;
  UpdateState(int64_t n, DType grad_dtype, bool with_out, DType out_dtype, uint32_t seed,
              bool specials)
      : grad(grad_dtype, n), has_out(with_out), out(out_dtype, with_out ? n : 0) {
    std::mt19937 rng(seed);
    master = random_floats(rng, n, -2.0f, 2.0f, false);
    s0 = random_floats(rng, n, -0.1f, 0.1f, false);
    s1 = random_floats(rng, n, 0.0f, 0.01f, false);
    const std::vector<float> g = random_floats(rng, n, -1.0f, 1.0f, specials);
    for (int64_t i = 0; i < n; ++i) grad.set(i, g[i]);
    dir = random_floats(rng, n, -0.5f, 0.5f, false);
    // Lion's sign(0): a zero gradient on a zero moment, where n allows.
    if (n > 3) {
      s0[3] = 0.0f;
      grad.set(3, 0.0f);
    }
    // Poison the copy-out so a kernel that skips it cannot pass.
    std::fill(out.bytes.begin(), out.bytes.end(), 0xFF);
  }
  UpdateArgs args() {
    UpdateArgs a;
    a.master = master.data();
    a.state0 = s0.data();
    a.state1 = s1.data();
    a.grad = grad.data();
    a.grad_dtype = grad.dtype;
    a.out = has_out ? out.data() : nullptr;
    a.out_dtype = out.dtype;
    a.dir = dir.data();
    a.n = static_cast<int64_t>(master.size());
    return a;
  }
};

template <class T>
bool same_bits(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() &&
         (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0);
}

// Parameterised over every ISA; only the ISAs this CPU lacks are skipped (scalar compares with
// itself, which still exercises the argument checks and the tails).
class IsaTest : public ::testing::TestWithParam<Isa> {
 protected:
  void SetUp() override {
    if (!isa_supported(GetParam())) {
      GTEST_SKIP() << "this CPU lacks " << isa_name(GetParam()) << "; nothing to compare";
    }
  }
  Isa isa() const { return GetParam(); }
};

// The contract: optimizer × grad dtype × copy-out × length (every tail shape of 8 and 16 lanes),
// random and special values, compared bit for bit with the scalar reference.
TEST_P(IsaTest, UpdateBitwiseEqualsScalar) {
  int checked = 0;
  for (const OptimizerCase& oc : optimizer_cases()) {
    for (DType gd : kDTypes) {
      for (int out = -1; out < 3; ++out) {
        const bool with_out = out >= 0;
        const DType od = with_out ? kDTypes[out] : DType::f32;
        for (int64_t n : kLengths) {
          for (bool specials : {false, true}) {
            const uint32_t seed = static_cast<uint32_t>(n * 131 + out * 7 + 1);
            UpdateState ref(n, gd, with_out, od, seed, specials);
            UpdateState got(n, gd, with_out, od, seed, specials);
            // Two steps, so the second reads state the kernel itself wrote.
            for (int step = 0; step < 2; ++step) {
              optimizer_update(Isa::scalar, oc.hyper, ref.args());
              optimizer_update(isa(), oc.hyper, got.args());
            }
            const std::string what = oc.name + " grad=" + dname(gd) +
                                     " out=" + (with_out ? dname(od) : "none") +
                                     " n=" + std::to_string(n) + (specials ? " specials" : "");
            ASSERT_TRUE(same_bits(ref.master, got.master)) << what;
            ASSERT_TRUE(same_bits(ref.s0, got.s0)) << what;
            ASSERT_TRUE(same_bits(ref.s1, got.s1)) << what;
            ASSERT_TRUE(ref.out.bytes == got.out.bytes) << what;
            ++checked;
          }
        }
      }
    }
  }
  EXPECT_EQ(checked, 7 * 3 * 4 * 11 * 2);
}

// Bitwise equality alone would pass two kernels that both do nothing: here every element must
// move, every state must be written, and the poisoned copy-out must hold convert(master).
TEST_P(IsaTest, UpdateChangesEveryElementAndWritesCopy) {
  for (const OptimizerCase& oc : optimizer_cases()) {
    for (DType od : kDTypes) {
      const int64_t n = 1000;
      UpdateState st(n, DType::f32, true, od, 99, false);
      const UpdateState before = st;
      optimizer_update(isa(), oc.hyper, st.args());
      for (int64_t i = 0; i < n; ++i) {
        if (i == 3) continue;  // the zero-gradient element (Lion's sign(0), tiny SGD step)
        ASSERT_NE(bits(st.master[i]), bits(before.master[i])) << oc.name << " i=" << i;
        Buf want(od, 1);
        want.set(0, st.master[i]);
        ASSERT_EQ(std::memcmp(&st.out.bytes[i * dsize(od)], want.bytes.data(), dsize(od)), 0)
            << oc.name << " out=" << dname(od) << " i=" << i;
      }
      const bool has_m = oc.hyper.kind != OptimizerKind::sgd || oc.hyper.momentum != 0;
      const bool has_v =
          oc.hyper.kind == OptimizerKind::adam || oc.hyper.kind == OptimizerKind::adamw;
      for (int64_t i = 0; i < n; ++i) {
        if (i == 3) continue;  // Lion's zero moment with a zero gradient stays zero
        if (has_m) {
          ASSERT_NE(bits(st.s0[i]), bits(before.s0[i])) << oc.name << " m i=" << i;
        }
        if (has_v) {
          ASSERT_NE(bits(st.s1[i]), bits(before.s1[i])) << oc.name << " v i=" << i;
        }
      }
    }
  }
}

// Error bound of the double-precision comparison below. Each f32 operation rounds with relative
// error at most u = 2^-24, so each result is within a small multiple of u of the exact value,
// measured against the magnitude that flowed into it: its "scale", the same recurrence run on
// absolute values (cancellation can shrink a value but not its scale). A step is about a dozen
// operations and errors carry over 5 steps; K = 32 covers that count (the worst case seen is
// about 9 u) and is still ~10^4 times tighter than a 1 % tolerance.
constexpr double kUnit = 1.0 / 16777216.0;
constexpr double kK = 32.0;
constexpr int kRefSteps = 5;

struct RefElem {
  double p, m, v;          // master, state0, state1 in double
  double sp, sm, sv;       // their scales
  bool ambiguous = false;  // Lion only: |c| so small that f32 may see the other sign
  double dir = 0;          // Muon only: the element's direction
};

void reference_step(const UpdateHyper& h, double g_in, RefElem& e) {
  const double lr = h.lr, b1 = h.beta1, b2 = h.beta2, wd = h.weight_decay, mom = h.momentum;
  double g = g_in * static_cast<double>(h.grad_scale);
  double sg = std::fabs(g);
  const double p0 = e.p;
  switch (h.kind) {
    case OptimizerKind::adam:
    case OptimizerKind::adamw: {
      if (h.kind == OptimizerKind::adam) {
        g += wd * p0;
        sg += wd * std::fabs(p0);
      } else {
        e.p -= lr * wd * p0;
        e.sp += lr * wd * std::fabs(p0);
      }
      e.m = b1 * e.m + (1 - b1) * g;
      e.sm = b1 * e.sm + (1 - b1) * sg;
      e.v = b2 * e.v + (1 - b2) * g * g;
      e.sv = b2 * e.sv + (1 - b2) * sg * sg;
      const double denom = std::sqrt(e.v / h.bias_correction2) + static_cast<double>(h.eps);
      e.p -= lr * (e.m / h.bias_correction1) / denom;
      // The step's error comes from m (relative to sm) and v (relative to sv, halved by sqrt).
      e.sp += lr * (e.sm / h.bias_correction1) / denom * (1 + e.sv / e.v);
      break;
    }
    case OptimizerKind::sgd: {
      g += wd * p0;
      sg += wd * std::fabs(p0);
      if (mom != 0) {
        e.m = mom * e.m + g;
        e.sm = mom * e.sm + sg;
        g = h.nesterov ? g + mom * e.m : e.m;
        sg = h.nesterov ? sg + mom * e.sm : e.sm;
      }
      e.p -= lr * g;
      e.sp += lr * sg;
      break;
    }
    case OptimizerKind::muon: {
      e.m = mom * e.m + (1 - mom) * g;
      e.sm = mom * e.sm + (1 - mom) * sg;
      e.p -= lr * wd * p0;
      e.p -= lr * e.dir;
      e.sp += lr * wd * std::fabs(p0) + lr * std::fabs(e.dir);
      break;
    }
    case OptimizerKind::lion: {
      const double c = b1 * e.m + (1 - b1) * g;
      if (std::fabs(c) <= 1e-4 * (b1 * e.sm + (1 - b1) * sg)) e.ambiguous = true;
      e.p -= lr * wd * p0;
      e.p -= lr * (c > 0 ? 1.0 : c < 0 ? -1.0 : 0.0);
      e.sp += lr * wd * std::fabs(p0) + lr;
      e.m = b2 * e.m + (1 - b2) * g;
      e.sm = b2 * e.sm + (1 - b2) * sg;
      break;
    }
  }
}

// The scalar reference itself: 5 steps of f32 against the formulas of cpu_kernels.hpp evaluated in
// double from the same inputs (the other ISAs follow by bitwise equality).
TEST(CpuKernels, ScalarUpdateMatchesDoubleReference) {
  double worst = 0;  // largest error / bound seen, printed to show the bound's head-room
  for (const OptimizerCase& oc : optimizer_cases()) {
    for (DType gd : kDTypes) {
      const int64_t n = 4099;
      UpdateState st(n, gd, false, DType::f32, 7, false);
      std::vector<RefElem> ref(n);
      for (int64_t i = 0; i < n; ++i) {
        const double p = st.master[i], m = st.s0[i], v = st.s1[i];
        ref[i] = {p, m, v, std::fabs(p), std::fabs(m), v};
        ref[i].dir = st.dir[size_t(i)];
      }
      for (int step = 0; step < kRefSteps; ++step) {
        optimizer_update(Isa::scalar, oc.hyper, st.args());
        for (int64_t i = 0; i < n; ++i) reference_step(oc.hyper, st.grad.get(i), ref[i]);
      }
      const bool has_m = oc.hyper.kind != OptimizerKind::sgd || oc.hyper.momentum != 0;
      const bool has_v =
          oc.hyper.kind == OptimizerKind::adam || oc.hyper.kind == OptimizerKind::adamw;
      int ambiguous = 0;
      for (int64_t i = 0; i < n; ++i) {
        const RefElem& e = ref[i];
        // An ambiguous Lion sign moves p by up to 2·lr per step; tolerate exactly that.
        const double slack = e.ambiguous ? 2.0 * oc.hyper.lr * kRefSteps : 0.0;
        const double bound_p = kK * kUnit * e.sp;
        const double err_p = std::fabs(st.master[i] - e.p);
        ASSERT_LE(err_p, bound_p + slack) << oc.name << " grad=" << dname(gd) << " i=" << i;
        if (!e.ambiguous) worst = std::max(worst, err_p / bound_p);
        ambiguous += e.ambiguous;
        if (has_m) {
          const double err_m = std::fabs(st.s0[i] - e.m);
          ASSERT_LE(err_m, kK * kUnit * e.sm) << oc.name << " m i=" << i;
          worst = std::max(worst, err_m / (kK * kUnit * e.sm));
        }
        if (has_v) {
          const double err_v = std::fabs(st.s1[i] - e.v);
          ASSERT_LE(err_v, kK * kUnit * e.sv) << oc.name << " v i=" << i;
          worst = std::max(worst, err_v / (kK * kUnit * e.sv));
        }
      }
      EXPECT_LT(ambiguous, n / 100) << oc.name;  // the slack covers only a few elements
    }
  }
  std::printf("worst error / bound: %.3g\n", worst);
}

TEST(CpuKernels, ConversionsMatchHandCheckedValues) {
  // bf16: exact cases, ties to even, overflow to inf, NaN stays a (quiet) NaN.
  EXPECT_EQ(float_to_bf16(1.0f), 0x3F80);
  EXPECT_EQ(float_to_bf16(-2.5f), 0xC020);
  EXPECT_EQ(float_to_bf16(from_bits(0x3F808000u)), 0x3F80);  // tie, 0x3F80 is even
  EXPECT_EQ(float_to_bf16(from_bits(0x3F818000u)), 0x3F82);  // tie, 0x3F81 is odd
  EXPECT_EQ(float_to_bf16(from_bits(0x3F808001u)), 0x3F81);  // just above the tie
  EXPECT_EQ(float_to_bf16(from_bits(0x7F7FFFFFu)), 0x7F80);  // FLT_MAX rounds to inf
  EXPECT_EQ(float_to_bf16(from_bits(0x00000001u)), 0x0000);  // smallest f32 subnormal
  EXPECT_EQ(float_to_bf16(from_bits(0x00018000u)), 0x0002);  // subnormal tie to even
  EXPECT_EQ(float_to_bf16(std::numeric_limits<float>::infinity()), 0x7F80);
  EXPECT_EQ(float_to_bf16(from_bits(0x7F800001u)), 0x7FC0);  // signalling NaN made quiet
  EXPECT_EQ(float_to_bf16(from_bits(0xFFC00000u)), 0xFFC0);
  EXPECT_EQ(bf16_to_float(0x3F80), 1.0f);
  EXPECT_EQ(bits(bf16_to_float(0x0001)), 0x00010000u);  // smallest bf16 subnormal
  EXPECT_TRUE(std::isnan(bf16_to_float(0x7FC1)));
  // f16: exact cases, the largest finite, the overflow tie, subnormals and their ties.
  EXPECT_EQ(float_to_f16(1.0f), 0x3C00);
  EXPECT_EQ(float_to_f16(-2.5f), 0xC100);
  EXPECT_EQ(float_to_f16(65504.0f), 0x7BFF);
  EXPECT_EQ(float_to_f16(65519.0f), 0x7BFF);
  EXPECT_EQ(float_to_f16(65520.0f), 0x7C00);  // tie between 65504 (odd) and 65536 → inf
  EXPECT_EQ(float_to_f16(-std::numeric_limits<float>::infinity()), 0xFC00);
  EXPECT_EQ(float_to_f16(std::ldexp(1.0f, -24)), 0x0001);     // smallest subnormal
  EXPECT_EQ(float_to_f16(std::ldexp(1.0f, -25)), 0x0000);     // tie → even zero
  EXPECT_EQ(float_to_f16(std::ldexp(1.5f, -25)), 0x0001);     // above the tie
  EXPECT_EQ(float_to_f16(std::ldexp(1.5f, -24)), 0x0002);     // tie 1.5 ulp → even 2
  EXPECT_EQ(float_to_f16(std::ldexp(1023.0f, -24)), 0x03FF);  // largest subnormal
  EXPECT_EQ(float_to_f16(std::ldexp(1.0f, -14)), 0x0400);     // smallest normal
  EXPECT_EQ(float_to_f16(-0.0f), 0x8000);
  const uint16_t nan16 = float_to_f16(std::numeric_limits<float>::quiet_NaN());
  EXPECT_EQ(nan16 & 0x7C00, 0x7C00);
  EXPECT_NE(nan16 & 0x03FF, 0);
  EXPECT_NE(float_to_f16(from_bits(0x7F800001u)) & 0x03FF, 0);  // payload lost, still NaN
  EXPECT_EQ(f16_to_float(0x0001), std::ldexp(1.0f, -24));
  EXPECT_EQ(f16_to_float(0x03FF), std::ldexp(1023.0f, -24));
  EXPECT_EQ(f16_to_float(0x7BFF), 65504.0f);
  EXPECT_EQ(f16_to_float(0x7C00), std::numeric_limits<float>::infinity());
  EXPECT_EQ(bits(f16_to_float(0x8000)), 0x80000000u);
  EXPECT_TRUE(std::isnan(f16_to_float(0x7E00)));
  EXPECT_TRUE(std::isnan(f16_to_float(0x7C01)));
}

// The compiler's _Float16 (IEEE, round to nearest even on x86) as an independent f16 reference:
// every f16 value widens the same, and a spread of floats across the whole range narrows the same.
TEST(CpuKernels, F16MatchesCompilerFloat16) {
#ifndef __FLT16_MAX__  // defined where the compiler has _Float16 (GCC 12+, clang 15+ on x86)
  GTEST_SKIP() << "this compiler has no _Float16 on this target";
#else
  for (uint32_t h = 0; h < 0x10000; ++h) {
    const uint16_t x = static_cast<uint16_t>(h);
    _Float16 c;
    std::memcpy(&c, &x, 2);
    if (std::isnan(static_cast<float>(c))) continue;
    ASSERT_EQ(bits(f16_to_float(x)), bits(static_cast<float>(c))) << std::hex << h;
  }
  std::mt19937 rng(5);
  for (int i = 0; i < 2000000; ++i) {
    // Exponents 96..160 cover zero-rounding, subnormal, normal and overflowing results.
    const uint32_t u = (rng() & 0x807FFFFFu) | ((96u + rng() % 65u) << 23);
    const float f = from_bits(u);
    const _Float16 c = static_cast<_Float16>(f);
    uint16_t want;
    std::memcpy(&want, &c, 2);
    ASSERT_EQ(float_to_f16(f), want) << std::hex << u;
  }
#endif
}

// All nine dtype pairs on random bit patterns (NaN payloads, subnormals, infinities included), and
// the scalar kernel against the element conversions checked by hand above.
TEST_P(IsaTest, ConvertBitwiseEqualsScalarForAllPairs) {
  std::mt19937 rng(11);
  // Random bit patterns: every class of float, NaN payloads included.
  const int64_t n = 70000;
  std::vector<uint32_t> raw(n);
  for (auto& r : raw) r = rng();
  for (DType sd : kDTypes) {
    Buf src(sd, n);
    std::memcpy(src.bytes.data(), raw.data(), src.bytes.size());
    for (DType dd : kDTypes) {
      for (int64_t len : {int64_t{0}, int64_t{1}, int64_t{17}, int64_t{4099}, n}) {
        Buf want(dd, len), got(dd, len);
        std::fill(got.bytes.begin(), got.bytes.end(), 0xA5);
        convert(Isa::scalar, src.data(), sd, want.data(), dd, len);
        convert(isa(), src.data(), sd, got.data(), dd, len);
        ASSERT_TRUE(want.bytes == got.bytes) << dname(sd) << "->" << dname(dd) << " n=" << len;
      }
      // The scalar kernel itself agrees with the element conversions.
      Buf want(dd, n);
      convert(Isa::scalar, src.data(), sd, want.data(), dd, n);
      for (int64_t i = 0; i < n; ++i) {
        const float v = src.get(i);
        if (sd == dd) continue;  // a byte copy, checked by the bitwise comparison above
        Buf one(dd, 1);
        one.set(0, v);
        ASSERT_EQ(std::memcmp(&want.bytes[i * dsize(dd)], one.bytes.data(), dsize(dd)), 0)
            << dname(sd) << "->" << dname(dd) << " i=" << i;
      }
    }
  }
}

// The one kernel allowed to differ per ISA (lane-parallel summation): relative 1e-12 of a
// long-double sum of the same widened values.
TEST_P(IsaTest, SumSquaresWithinBoundOfLongDouble) {
  for (DType d : kDTypes) {
    for (int64_t n : {int64_t{0}, int64_t{1}, int64_t{17}, int64_t{4099}, int64_t{100003}}) {
      std::mt19937 rng(static_cast<uint32_t>(n));
      const std::vector<float> x = random_floats(rng, n, -3.0f, 3.0f, false);
      Buf b(d, n);
      long double want = 0;
      for (int64_t i = 0; i < n; ++i) {
        b.set(i, x[i]);
        const long double v = b.get(i);
        want += v * v;
      }
      const double got = sum_squares(isa(), b.data(), d, n);
      EXPECT_LE(std::fabs(static_cast<long double>(got) - want), 1e-12L * want)
          << dname(d) << " n=" << n;
      if (n > 0) {
        EXPECT_GT(got, 0.0);
      }
    }
  }
}

// accumulate sums in f32; add_into widens, adds and rounds once. Both bitwise across ISAs and
// against the same operations spelled out element by element.
TEST_P(IsaTest, AccumulateAndAddIntoBitwiseEqualScalar) {
  for (DType d : kDTypes) {
    for (int64_t n : kLengths) {
      std::mt19937 rng(static_cast<uint32_t>(n + 3));
      const std::vector<float> a = random_floats(rng, n, -4.0f, 4.0f, true);
      const std::vector<float> g = random_floats(rng, n, -4.0f, 4.0f, true);
      Buf gb(d, n), ab(d, n);
      for (int64_t i = 0; i < n; ++i) gb.set(i, g[i]), ab.set(i, a[i]);

      std::vector<float> acc_ref = a, acc_got = a;
      accumulate(Isa::scalar, acc_ref.data(), gb.data(), d, n);
      accumulate(isa(), acc_got.data(), gb.data(), d, n);
      ASSERT_TRUE(same_bits(acc_ref, acc_got)) << "accumulate " << dname(d) << " n=" << n;
      for (int64_t i = 0; i < n; ++i) {
        const float want = a[i] + gb.get(i);
        ASSERT_TRUE(bits(acc_ref[i]) == bits(want) || (std::isnan(want) && std::isnan(acc_ref[i])));
      }

      Buf sum_ref = ab, sum_got = ab;
      add_into(Isa::scalar, sum_ref.data(), gb.data(), d, n);
      add_into(isa(), sum_got.data(), gb.data(), d, n);
      ASSERT_TRUE(sum_ref.bytes == sum_got.bytes) << "add_into " << dname(d) << " n=" << n;
      for (int64_t i = 0; i < n; ++i) {
        Buf one(d, 1);
        one.set(0, ab.get(i) + gb.get(i));  // widen, add in f32, round once
        ASSERT_TRUE(std::memcmp(&sum_ref.bytes[i * dsize(d)], one.bytes.data(), dsize(d)) == 0 ||
                    std::isnan(one.get(0)))
            << "add_into " << dname(d) << " i=" << i;
      }
    }
  }
}

// same_bytes must really read and write every stream (the write streams start poisoned), or the
// benchmark's ceiling would be fake.
TEST_P(IsaTest, SameBytesWritesXorOfReads) {
  for (int64_t n : kLengths) {
    for (int r = 0; r <= 4; ++r) {
      for (int w = 1; w <= 4; ++w) {
        std::mt19937 rng(static_cast<uint32_t>(n * 10 + r));
        std::vector<std::vector<float>> rd(r), wr(w, std::vector<float>(n, -7.0f));
        std::vector<const float*> rp;
        std::vector<float*> wp;
        for (auto& s : rd) s = random_floats(rng, n, -1.0f, 1.0f, false), rp.push_back(s.data());
        for (auto& s : wr) wp.push_back(s.data());
        same_bytes(isa(), rp.data(), r, wp.data(), w, n);
        for (int64_t i = 0; i < n; ++i) {
          uint32_t want = 0;
          for (auto& s : rd) want ^= bits(s[i]);
          for (auto& s : wr) ASSERT_EQ(bits(s[i]), want) << "r=" << r << " w=" << w << " i=" << i;
        }
      }
    }
  }
}

// Contract violations are zeroshard::Error, never a crash inside a loop.
TEST(CpuKernels, IsaSelectionAndArgumentChecks) {
  EXPECT_TRUE(isa_supported(Isa::scalar));
  EXPECT_TRUE(isa_supported(best_isa()));
  EXPECT_STREQ(isa_name(Isa::avx512), "avx512");
  UpdateHyper h;
  UpdateArgs a;
  a.n = -1;
  EXPECT_THROW(optimizer_update(Isa::scalar, h, a), Error);
  float p = 1.0f, g = 1.0f;
  a.n = 1;
  a.master = &p;
  a.grad = &g;
  EXPECT_THROW(optimizer_update(Isa::scalar, h, a), Error);  // adamw without its states
  EXPECT_THROW(same_bytes(Isa::scalar, nullptr, 9, nullptr, 0, 1), Error);
  for (Isa i : {Isa::avx2, Isa::avx512}) {
    if (!isa_supported(i)) {
      EXPECT_THROW(sum_squares(i, &p, DType::f32, 1), Error);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(AllIsas, IsaTest, ::testing::Values(Isa::scalar, Isa::avx2, Isa::avx512),
                         [](const ::testing::TestParamInfo<Isa>& param_info) {
                           return std::string(isa_name(param_info.param));
                         });

}  // namespace
}  // namespace zeroshard::cpu
