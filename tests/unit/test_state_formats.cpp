// Optimizer state formats (Config::optimizer_state): the 8-bit dynamic code against an
// independent evaluation of the published map, the bucket lookup against the nearest code
// point, and the bf16 and q8 updates against their definition (f32 update of the widened
// state, then rounding or requantization), bitwise, on every ISA.

#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "kernels/cpu/cpu_kernels.hpp"
#include "kernels/cpu/quant_code.hpp"
#include "zeroshard/error.hpp"

namespace zeroshard::cpu {
namespace {

// The published map written out differently from quant_code.cpp: per decade, the code points
// are 10^e × (0.1 + 0.9 (j + 1/2) / k), k = 2^i (signed) or 2^(i+1) (unsigned).
std::vector<double> reference_map(bool is_signed) {
  std::vector<double> v{0.0, 1.0};
  for (int i = 0; i < 7; ++i) {
    const int k = is_signed ? 1 << i : 1 << (i + 1);
    for (int j = 0; j < k; ++j) {
      const double x = std::pow(10.0, i - 6) * (0.1 + 0.9 * (j + 0.5) / k);
      v.push_back(x);
      if (is_signed) v.push_back(-x);
    }
  }
  std::sort(v.begin(), v.end());
  return v;
}

TEST(StateFormats, DynamicCodeIsThePublishedMap) {
  for (bool is_signed : {true, false}) {
    const QuantCode& c = dynamic_code(is_signed);
    const std::vector<double> ref = reference_map(is_signed);
    ASSERT_EQ(ref.size(), 256u);
    for (int i = 0; i < 256; ++i) {
      // Rounded once from double: within half an ulp of the exact value.
      EXPECT_NEAR(c.code[i], ref[size_t(i)], std::abs(ref[size_t(i)]) * 6e-8) << i;
      if (i > 0) {
        EXPECT_LT(c.code[i - 1], c.code[i]);
      }
    }
    EXPECT_EQ(c.code[c.zero], 0.0f);
    EXPECT_EQ(c.code[255], 1.0f);
    EXPECT_EQ(c.code[0], is_signed ? -0.99296875f : 0.0f);
  }
}

// The bucket lookup is the exact count of midpoints below x, and that is the nearest code
// point: checked on every code point, every midpoint and its float neighbours, and random
// values over all magnitudes.
TEST(StateFormats, LookupFindsTheNearestCodePoint) {
  std::mt19937 rng(7);
  for (bool is_signed : {true, false}) {
    const QuantCode& c = dynamic_code(is_signed);
    std::vector<float> xs;
    for (int i = 0; i < 255; ++i) {
      for (float x : {c.code[i], c.mid[i]}) {
        xs.push_back(x);
        xs.push_back(std::nextafter(x, 2.0f));
        xs.push_back(std::nextafter(x, -2.0f));
      }
    }
    std::uniform_real_distribution<float> e(-30.0f, 0.0f);
    for (int i = 0; i < 200000; ++i) {
      const float x = std::exp2(e(rng));
      xs.push_back(x);
      if (is_signed) xs.push_back(-x);
    }
    xs.push_back(1.0f);
    if (is_signed) xs.push_back(-1.0f);
    int checked = 0, other_absmax = 0;
    // block 1 would renormalise every value to ±1: quantize x directly through the update's
    // lookup by making x its own block of two with a 1.0 beside it.
    for (size_t k = 0; k < xs.size(); ++k) {
      const float x = xs[k];
      if (!is_signed && x < 0) continue;
      const float pair[2] = {x, 1.0f};
      uint8_t qq[2];
      float am;
      quantize_blocks(Isa::scalar, pair, 2, 2, is_signed, qq, &am);
      // Rarely {x, 1} is exactly a dequantized block of another absmax (1 = 0.99297 × A), which
      // quantize_blocks restores as such: then it says nothing about the lookup.
      if (am != 1.0f) {
        ++other_absmax;
        continue;
      }
      ++checked;
      int exact = 0;
      while (exact < 255 && c.mid[exact] < x) ++exact;
      ASSERT_EQ(int(qq[0]), exact) << "x=" << x;
      // Nearest in exact arithmetic, up to ties at the f32-rounded midpoint.
      for (int j = 0; j < 256; ++j) {
        const double dj = std::abs(double(c.code[j]) - x), dq = std::abs(double(c.code[exact]) - x);
        ASSERT_LE(dq, dj + std::abs(double(x)) * 1.2e-7 + 1e-30) << "x=" << x << " j=" << j;
      }
    }
    EXPECT_LT(other_absmax, checked / 1000);
  }
}

constexpr Isa kIsas[] = {Isa::scalar, Isa::avx2, Isa::avx512};
constexpr int64_t kLengths[] = {1, 15, 16, 17, 255, 256, 257, 1000, 4096, 5000};

// Quantize and dequantize agree bitwise across ISAs, and the round trip is within the code's
// spacing: |x - x'| <= absmax × (the largest gap between neighbouring code points) / 2.
TEST(StateFormats, BlockQuantizationBitwiseAcrossIsas) {
  std::mt19937 rng(11);
  for (bool is_signed : {true, false}) {
    const QuantCode& c = dynamic_code(is_signed);
    double gap = 0;
    for (int i = 0; i < 255; ++i) gap = std::max(gap, double(c.code[i + 1]) - c.code[i]);
    for (int64_t n : kLengths) {
      for (int64_t block : {int64_t(64), int64_t(256), int64_t(2048)}) {
        std::normal_distribution<float> d(0.0f, 1e-3f);
        std::vector<float> x(static_cast<size_t>(n));
        for (float& v : x) v = is_signed ? d(rng) : std::abs(d(rng));
        if (n > 20) std::fill(x.begin() + 3, x.begin() + 3 + std::min<int64_t>(n - 3, block), 0.0f);
        const int64_t blocks = (n + block - 1) / block;
        std::vector<uint8_t> q_ref(static_cast<size_t>(n));
        std::vector<float> a_ref(static_cast<size_t>(blocks)), back_ref(static_cast<size_t>(n));
        quantize_blocks(Isa::scalar, x.data(), n, block, is_signed, q_ref.data(), a_ref.data());
        dequantize_blocks(Isa::scalar, q_ref.data(), a_ref.data(), n, block, is_signed,
                          back_ref.data());
        for (int64_t i = 0; i < n; ++i) {
          const double am = a_ref[size_t(i / block)];
          ASSERT_LE(std::abs(double(back_ref[size_t(i)]) - x[size_t(i)]), am * gap / 2 * 1.0001)
              << "n=" << n << " i=" << i;
        }
        for (Isa isa : kIsas) {
          if (!isa_supported(isa)) continue;
          std::vector<uint8_t> q(static_cast<size_t>(n));
          std::vector<float> a(static_cast<size_t>(blocks)), back(static_cast<size_t>(n));
          quantize_blocks(isa, x.data(), n, block, is_signed, q.data(), a.data());
          dequantize_blocks(isa, q.data(), a.data(), n, block, is_signed, back.data());
          ASSERT_EQ(q, q_ref) << isa_name(isa) << " n=" << n << " block=" << block;
          ASSERT_EQ(a, a_ref) << isa_name(isa);
          ASSERT_EQ(0, std::memcmp(back.data(), back_ref.data(), size_t(n) * 4)) << isa_name(isa);
        }
      }
    }
  }
}

// Every code index, in every lane position, dequantizes to its code point × absmax on every ISA
// (AVX-512 looks codes up by register permutes and blends, one bit of the index at a time; with
// VBMI, by byte permutes of 64 indices reordered first).
TEST(StateFormats, EveryCodeDequantizesToItsPoint) {
  // Index i at position i % 64 and, shifted by one each round, at every other of the 64.
  const int64_t n = 256 * 65 + 7;
  std::vector<uint8_t> q(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) q[size_t(i)] = uint8_t((i + i / 256) % 256);
  const float absmax[] = {0.75f};
  for (bool is_signed : {true, false}) {
    const QuantCode& c = dynamic_code(is_signed);
    for (Isa isa : kIsas) {
      if (!isa_supported(isa)) continue;
      std::vector<float> x(static_cast<size_t>(n));
      dequantize_blocks(isa, q.data(), absmax, n, n, is_signed, x.data());
      for (int64_t i = 0; i < n; ++i)
        ASSERT_EQ(x[size_t(i)], c.code[q[size_t(i)]] * 0.75f)
            << isa_name(isa) << " index " << int(q[size_t(i)]) << " at " << i;
    }
  }
}

UpdateHyper hyper(OptimizerKind kind, float momentum = 0.0f) {
  UpdateHyper h;
  h.kind = kind;
  h.lr = kind == OptimizerKind::sgd ? 0.05f : 1e-3f;
  h.beta1 = 0.9f;
  h.beta2 = kind == OptimizerKind::lion ? 0.99f : 0.999f;
  h.eps = 1e-8f;
  h.weight_decay = 0.01f;
  h.momentum = momentum;
  h.bias_correction1 = 0.19f;
  h.bias_correction2 = 0.002f;
  h.grad_scale = 1.0f / 3.0f;
  return h;
}

std::vector<UpdateHyper> all_optimizers() {
  return {hyper(OptimizerKind::adam), hyper(OptimizerKind::adamw), hyper(OptimizerKind::lion),
          hyper(OptimizerKind::sgd, 0.9f)};
}

// The arrays of one update in any state format; `f32_view` widens the moments for comparison.
struct State {
  StateFormat format;
  int64_t n, block;
  std::vector<float> master;
  std::vector<uint16_t> grad, out;
  std::vector<unsigned char> s0, s1;
  std::vector<float> a0, a1;
  State(StateFormat f, int64_t n_, int64_t block_, uint32_t seed)
      : format(f), n(n_), block(block_), grad(static_cast<size_t>(n_)), out(size_t(n_), 0xFFFF) {
    std::mt19937 rng(seed);
    std::uniform_real_distribution<float> u(-1.0f, 1.0f);
    for (int64_t i = 0; i < n; ++i) {
      master.push_back(u(rng));
      grad[size_t(i)] = float_to_bf16(u(rng));
    }
    s0.assign(size_t(n) * state_bytes(f), 0);
    s1.assign(size_t(n) * state_bytes(f), 0);
    const int64_t blocks = (n + block - 1) / block;
    a0.assign(size_t(blocks), 0.0f);
    a1.assign(size_t(blocks), 0.0f);
    if (f == StateFormat::q8) {  // all-zero state is the code's 0, not index 0
      std::fill(s0.begin(), s0.end(), dynamic_code(true).zero);
      std::fill(s1.begin(), s1.end(), dynamic_code(false).zero);
    }
  }
  UpdateArgs args() {
    UpdateArgs a;
    a.master = master.data();
    a.state0 = s0.data();
    a.state1 = s1.data();
    a.state_format = format;
    a.absmax0 = a0.data();
    a.absmax1 = a1.data();
    a.block = block;
    a.grad = grad.data();
    a.grad_dtype = DType::bf16;
    a.out = out.data();
    a.out_dtype = DType::bf16;
    a.n = n;
    return a;
  }
  std::vector<float> moment(int which) const {
    const auto& s = which == 0 ? s0 : s1;
    std::vector<float> f(static_cast<size_t>(n));
    if (format == StateFormat::f32) {
      std::memcpy(f.data(), s.data(), size_t(n) * 4);
    } else if (format == StateFormat::bf16) {
      for (int64_t i = 0; i < n; ++i) {
        uint16_t h;
        std::memcpy(&h, &s[size_t(i) * 2], 2);
        f[size_t(i)] = bf16_to_float(h);
      }
    } else {
      dequantize_blocks(Isa::scalar, s.data(), (which == 0 ? a0 : a1).data(), n, block, which == 0,
                        f.data());
    }
    return f;
  }
  bool operator==(const State& o) const {
    return std::memcmp(master.data(), o.master.data(), size_t(n) * 4) == 0 && s0 == o.s0 &&
           s1 == o.s1 && out == o.out && a0 == o.a0 && a1 == o.a1;
  }
};

// bf16 and q8 updates on every ISA equal the scalar one, over several steps (so each reads
// what it wrote), every optimizer, lengths with partial vectors and blocks.
TEST(StateFormats, CompactUpdatesBitwiseAcrossIsas) {
  for (StateFormat f : {StateFormat::bf16, StateFormat::q8}) {
    for (const UpdateHyper& h : all_optimizers()) {
      for (int64_t n : kLengths) {
        for (int64_t block : {int64_t(256), int64_t(2048)}) {
          State ref(f, n, block, uint32_t(n));
          for (int s = 0; s < 3; ++s) optimizer_update(Isa::scalar, h, ref.args());
          for (Isa isa : kIsas) {
            if (!isa_supported(isa) || isa == Isa::scalar) continue;
            State got(f, n, block, uint32_t(n));
            for (int s = 0; s < 3; ++s) optimizer_update(isa, h, got.args());
            ASSERT_TRUE(got == ref) << state_format_name(f) << " " << optimizer_name(h.kind)
                                    << " n=" << n << " " << isa_name(isa);
          }
          if (f == StateFormat::bf16) break;  // no blocks
        }
      }
    }
  }
}

// The definitions, exactly: bf16 = the f32 update of the widened moments, each rounded to
// nearest even; q8 = dequantize, the f32 update, requantize. A kernel that skipped the update
// or stored f32 bits would differ here.
TEST(StateFormats, CompactUpdateIsTheF32UpdateOfTheWidenedState) {
  const int64_t n = 5000, block = 256;
  for (StateFormat f : {StateFormat::bf16, StateFormat::q8}) {
    for (const UpdateHyper& h : all_optimizers()) {
      State st(f, n, block, 3);
      // Block 1 gets no gradient: AdamW's m and v stay all zero there (the code's 0, absmax 0)
      // while the other blocks' move.
      std::fill(st.grad.begin() + block, st.grad.begin() + 2 * block, uint16_t(0));
      for (int step = 0; step < 4; ++step) {
        // The f32 reference starts from the compact state widened.
        State f32(StateFormat::f32, n, block, 3);
        f32.master = st.master;
        f32.grad = st.grad;
        std::vector<float> m = st.moment(0), v = st.moment(1);
        std::memcpy(f32.s0.data(), m.data(), size_t(n) * 4);
        std::memcpy(f32.s1.data(), v.data(), size_t(n) * 4);
        optimizer_update(best_isa(), h, f32.args());
        optimizer_update(best_isa(), h, st.args());
        ASSERT_EQ(0, std::memcmp(st.master.data(), f32.master.data(), size_t(n) * 4));
        ASSERT_EQ(st.out, f32.out);
        const std::vector<float> m32 = f32.moment(0), v32 = f32.moment(1);
        const bool has_v = h.kind == OptimizerKind::adam || h.kind == OptimizerKind::adamw;
        if (f == StateFormat::bf16) {
          for (int64_t i = 0; i < n; ++i) {
            uint16_t got0, got1;
            std::memcpy(&got0, &st.s0[size_t(i) * 2], 2);
            std::memcpy(&got1, &st.s1[size_t(i) * 2], 2);
            ASSERT_EQ(got0, float_to_bf16(m32[size_t(i)])) << i;
            if (has_v) {
              ASSERT_EQ(got1, float_to_bf16(v32[size_t(i)])) << i;
            }
          }
        } else {
          std::vector<uint8_t> q(static_cast<size_t>(n));
          std::vector<float> a(static_cast<size_t>((n + block - 1) / block));
          quantize_blocks(Isa::scalar, m32.data(), n, block, true, q.data(), a.data());
          ASSERT_TRUE(std::equal(q.begin(), q.end(), st.s0.begin())) << step;
          ASSERT_EQ(a, st.a0);
          if (has_v) {
            quantize_blocks(Isa::scalar, v32.data(), n, block, false, q.data(), a.data());
            ASSERT_TRUE(std::equal(q.begin(), q.end(), st.s1.begin())) << step;
            ASSERT_EQ(a, st.a1);
          }
        }
        // Something moved: the moments are not all zero after a step.
        ASSERT_GT(*std::max_element(m32.begin(), m32.end()), 0.0f);
      }
    }
  }
}

// Segments: two groups with different learning rates and a gap (padding) inside one block give
// the same result as updating each group alone with its own hyperparameters, and the gap's
// elements keep their value.
TEST(StateFormats, SegmentsUpdateEachGroupWithItsOwnHyper) {
  const int64_t n = 1024, block = 256;
  UpdateHyper h1 = hyper(OptimizerKind::adamw), h2 = hyper(OptimizerKind::adamw);
  h2.lr = 5e-2f;
  State st(StateFormat::q8, n, block, 5);
  const std::vector<float> before = st.master;
  const UpdateSegment segs[] = {{0, 300, &h1}, {310, 1000, &h2}};
  optimizer_update_segments(best_isa(), segs, 2, st.args());
  // Element-wise reference: the f32 update with each element's hyper, from a zero state.
  State f32(StateFormat::f32, n, block, 5);
  UpdateArgs a = f32.args();
  a.n = 300;
  optimizer_update(Isa::scalar, h1, a);
  UpdateArgs b = f32.args();
  b.master = static_cast<float*>(b.master) + 310;
  b.state0 = static_cast<float*>(b.state0) + 310;
  b.state1 = static_cast<float*>(b.state1) + 310;
  b.grad = static_cast<const uint16_t*>(b.grad) + 310;
  b.out = static_cast<uint16_t*>(b.out) + 310;
  b.n = 690;
  optimizer_update(Isa::scalar, h2, b);
  for (int64_t i = 0; i < n; ++i) {
    const bool in = i < 300 || (i >= 310 && i < 1000);
    ASSERT_EQ(std::bit_cast<uint32_t>(st.master[size_t(i)]),
              std::bit_cast<uint32_t>(in ? f32.master[size_t(i)] : before[size_t(i)]))
        << i;
  }
  EXPECT_THROW(optimizer_update_segments(best_isa(), segs + 1, -1, st.args()), Error);
  const UpdateSegment bad[] = {{310, 1000, &h1}, {0, 300, &h2}};
  EXPECT_THROW(optimizer_update_segments(best_isa(), bad, 2, st.args()), Error);
}

// SGD groups with and without momentum share a unit (Engine::num_states keeps the buffer when
// any group has momentum): whichever group's segment comes first, each element takes the f32
// update of the widened state with its own group's hyperparameters, and the plain group's
// elements leave their momentum at zero.
TEST(StateFormats, SegmentsOfSgdWithAndWithoutMomentum) {
  const int64_t n = 1024, block = 256, cut = 300;
  const UpdateHyper plain = hyper(OptimizerKind::sgd), heavy = hyper(OptimizerKind::sgd, 0.9f);
  for (bool plain_first : {true, false}) {
    SCOPED_TRACE(plain_first ? "plain group first" : "momentum group first");
    const UpdateHyper& h1 = plain_first ? plain : heavy;
    const UpdateHyper& h2 = plain_first ? heavy : plain;
    State st(StateFormat::q8, n, block, 9);
    const UpdateSegment segs[] = {{0, cut, &h1}, {cut, n, &h2}};
    for (int step = 0; step < 3; ++step) {
      // The f32 reference starts from the compact state widened.
      State f32(StateFormat::f32, n, block, 9);
      f32.master = st.master;
      const std::vector<float> m_before = st.moment(0);
      std::memcpy(f32.s0.data(), m_before.data(), size_t(n) * 4);
      optimizer_update_segments(best_isa(), segs, 2, st.args());
      UpdateArgs a = f32.args();
      a.n = cut;
      optimizer_update(Isa::scalar, h1, a);
      UpdateArgs b = f32.args();
      b.master = static_cast<float*>(b.master) + cut;
      b.state0 = static_cast<float*>(b.state0) + cut;
      b.grad = static_cast<const uint16_t*>(b.grad) + cut;
      b.out = static_cast<uint16_t*>(b.out) + cut;
      b.n = n - cut;
      optimizer_update(Isa::scalar, h2, b);
      ASSERT_EQ(0, std::memcmp(st.master.data(), f32.master.data(), size_t(n) * 4)) << step;
      const std::vector<float> m = st.moment(0);
      for (int64_t i = 0; i < n; ++i) {
        if ((i < cut) == plain_first) {
          ASSERT_EQ(m[size_t(i)], 0.0f) << i;
        } else {
          ASSERT_NE(m[size_t(i)], 0.0f) << i;  // the momentum group's buffer moved
        }
      }
    }
  }
}

// A block that no segment touches keeps its codes and absmax, even where requantizing them
// would change them (a block whose largest magnitude sits on the signed map's most negative
// point, -0.99297, would come back with another absmax).
TEST(StateFormats, BlocksNoSegmentTouchesStayAsTheyAre) {
  const int64_t n = 1024, block = 256;
  const UpdateHyper h = hyper(OptimizerKind::adamw);
  State st(StateFormat::q8, n, block, 4);
  const QuantCode& c0 = dynamic_code(true);
  float largest = 0.0f;
  for (int64_t i = 512; i < n; ++i) {
    st.s0[size_t(i)] = uint8_t(i % 200);  // code 0 (-0.99297) is the largest magnitude
    largest = std::max(largest, std::fabs(c0.code[st.s0[size_t(i)]] * 0.5f));
  }
  st.a0[2] = st.a0[3] = 0.5f;
  ASSERT_NE(largest, 0.5f);  // requantizing would change the absmax: the check below can fail
  const std::vector<unsigned char> s0 = st.s0;
  const std::vector<float> a0 = st.a0;
  const UpdateSegment segs[] = {{0, 300, &h}};
  optimizer_update_segments(best_isa(), segs, 1, st.args());
  EXPECT_TRUE(std::equal(st.s0.begin() + 512, st.s0.end(), s0.begin() + 512));
  EXPECT_EQ(st.a0[2], a0[2]);
  EXPECT_EQ(st.a0[3], a0[3]);
  // The touched blocks did change.
  EXPECT_FALSE(std::equal(st.s0.begin(), st.s0.begin() + 300, s0.begin()));
}

// A q8 state widened to f32 (read_shard, checkpoints) and quantized again is the same state, bit
// for bit, on every ISA: including blocks whose largest magnitude is negative, where max |x| is
// not the absmax (the signed map has no −1). Those blocks must occur here, or the test would
// not cover the recovery.
TEST(StateFormats, WidenedQ8StateQuantizesBackExactly) {
  const int64_t n = 64 * 300, block = 64;
  State st(StateFormat::q8, n, block, 17);
  for (int s = 0; s < 3; ++s) optimizer_update(best_isa(), hyper(OptimizerKind::adamw), st.args());
  int negative_max = 0;
  for (int which = 0; which < 2; ++which) {
    const std::vector<float> x = st.moment(which);
    const auto& q_ref = which == 0 ? st.s0 : st.s1;
    const auto& a_ref = which == 0 ? st.a0 : st.a1;
    for (int64_t b = 0; b < n; b += block) {
      float m = 0;
      for (int64_t i = b; i < b + block; ++i) m = std::max(m, std::abs(x[size_t(i)]));
      negative_max += m != a_ref[size_t(b / block)];
    }
    for (Isa isa : kIsas) {
      if (!isa_supported(isa)) continue;
      std::vector<uint8_t> q(static_cast<size_t>(n));
      std::vector<float> a(a_ref.size());
      quantize_blocks(isa, x.data(), n, block, which == 0, q.data(), a.data());
      ASSERT_TRUE(std::equal(q.begin(), q.end(), q_ref.begin())) << isa_name(isa) << which;
      ASSERT_EQ(a, a_ref) << isa_name(isa);
    }
  }
  EXPECT_GT(negative_max, 10);
}

TEST(StateFormats, ArgumentChecks) {
  State st(StateFormat::q8, 512, 256, 1);
  UpdateArgs a = st.args();
  a.block = 0;
  EXPECT_THROW(optimizer_update(Isa::scalar, hyper(OptimizerKind::adam), a), Error);
  a = st.args();
  a.block = kMaxStateBlock * 2;
  EXPECT_THROW(optimizer_update(Isa::scalar, hyper(OptimizerKind::adam), a), Error);
  a = st.args();
  a.absmax1 = nullptr;
  EXPECT_THROW(optimizer_update(Isa::scalar, hyper(OptimizerKind::adam), a), Error);
  // Lion keeps one moment: no second absmax needed.
  EXPECT_NO_THROW(optimizer_update(Isa::scalar, hyper(OptimizerKind::lion), a));
}

}  // namespace
}  // namespace zeroshard::cpu
