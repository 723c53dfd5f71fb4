// Optimizer state formats (Config::optimizer_state): the 8-bit code against an independent
// construction of its points, its encoding against the nearest point, and the bf16 and q8
// updates against their definition (f32 update of the widened state, then rounding or
// requantization), bitwise, on every ISA.

#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "kernels/cpu/cpu_kernels.hpp"
#include "kernels/cpu/quant_code.hpp"
#include "zeroshard/error.hpp"

namespace zeroshard::cpu {
namespace {

constexpr Isa kIsas[] = {Isa::scalar, Isa::avx2, Isa::avx512};
constexpr int64_t kLengths[] = {1, 15, 16, 17, 255, 256, 257, 1000, 4096, 5000};

// The magnitudes of a code, ascending, code 0 (0.0) first, built from the definition in
// quant_code.hpp rather than from bit patterns: the largest `top` of the points (1 + f/8) 2^e,
// f = 0..7, up to 1.0.
std::vector<double> magnitudes(bool is_signed) {
  std::set<double> all{1.0};
  for (int e = -40; e < 0; ++e)
    for (int f = 0; f < 8; ++f) all.insert((1.0 + f / 8.0) * std::ldexp(1.0, e));
  const size_t top = is_signed ? 127 : 255;
  std::vector<double> m{0.0};
  m.insert(m.end(), std::prev(all.end(), long(top)), all.end());
  return m;
}

float point(uint8_t q, bool is_signed) {
  return std::bit_cast<float>(is_signed ? Q8Code<true>::point_bits(q)
                                        : Q8Code<false>::point_bits(q));
}

TEST(StateFormats, Q8CodeIsItsDefinition) {
  for (bool is_signed : {true, false}) {
    const std::vector<double> mag = magnitudes(is_signed);
    for (int q = 0; q < 256; ++q) {
      const int c = is_signed ? q & 0x7F : q;
      const double want = (is_signed && q >= 128 ? -1.0 : 1.0) * mag[size_t(c)];
      ASSERT_EQ(double(point(uint8_t(q), is_signed)), want) << q;
    }
    EXPECT_EQ(point(is_signed ? 127 : 255, is_signed), 1.0f);
    // NaN of either sign (x86 makes 0xFFC00000, CUDA 0x7FFFFFFF) is the largest code, without
    // a sign; ±inf keeps its sign.
    const int top = is_signed ? 127 : 255;
    for (uint32_t nan : {0x7FC00000u, 0xFFC00000u, 0x7FFFFFFFu, 0xFF800001u}) {
      EXPECT_EQ(is_signed ? Q8Code<true>::encode(nan) : Q8Code<false>::encode(nan), top) << nan;
    }
    // -inf: the signed code's -1.0 (128 + 127), the unsigned one's magnitude 1.0.
    EXPECT_EQ(is_signed ? Q8Code<true>::encode(0xFF800000u) : Q8Code<false>::encode(0xFF800000u),
              255);
    EXPECT_EQ(is_signed ? Q8Code<true>::encode(0x7F800000u) : Q8Code<false>::encode(0x7F800000u),
              top);
    EXPECT_EQ(double(point(1, is_signed)), 1.25 * std::ldexp(1.0, is_signed ? -16 : -32));
  }
}

// Codes for values given as fractions of their block's absmax: each value x in a block of two
// with 1.0 beside it (so absmax 1, and x × (1 / 1) = x), on every ISA.
std::vector<std::vector<uint8_t>> codes_of(const std::vector<float>& xs, bool is_signed) {
  std::vector<float> pairs;
  for (float x : xs) pairs.insert(pairs.end(), {x, 1.0f});
  const int64_t n = int64_t(pairs.size());
  std::vector<std::vector<uint8_t>> out;
  for (Isa isa : kIsas) {
    if (!isa_supported(isa)) continue;
    std::vector<uint8_t> q(static_cast<size_t>(n)), codes;
    std::vector<float> am(size_t(n / 2));
    quantize_blocks(isa, pairs.data(), n, 2, is_signed, q.data(), am.data());
    for (size_t k = 0; k < xs.size(); ++k) {
      EXPECT_EQ(am[k], 1.0f);
      codes.push_back(q[2 * k]);
    }
    out.push_back(codes);
  }
  return out;
}

// The code of x is its nearest point, ties to the larger magnitude, the sign kept where the
// magnitude's code is not 0: checked by brute force on every point, every midpoint and their
// float neighbours, random values over all magnitudes, and the edges (0, -0, denormals, NaN).
TEST(StateFormats, EncodeFindsTheNearestPoint) {
  std::mt19937 rng(7);
  for (bool is_signed : {true, false}) {
    const std::vector<double> mag = magnitudes(is_signed);
    std::vector<float> xs{0.0f, 1.0f, std::numeric_limits<float>::denorm_min(), 1e-39f,
                          std::numeric_limits<float>::min()};
    for (size_t c = 0; c < mag.size(); ++c) {
      std::vector<float> around{float(mag[c])};
      if (c + 1 < mag.size()) around.push_back(float((mag[c] + mag[c + 1]) / 2));
      for (float x : around) {
        xs.push_back(x);
        if (x < 1.0f) xs.push_back(std::nextafter(x, 2.0f));
        if (x > 0.0f) xs.push_back(std::nextafter(x, -2.0f));
      }
    }
    std::uniform_real_distribution<float> e(-40.0f, 0.0f);
    for (int i = 0; i < 100000; ++i) xs.push_back(std::exp2(e(rng)));
    if (is_signed) {
      const size_t half = xs.size();
      for (size_t k = 0; k < half; ++k) xs.push_back(-xs[k]);
    }
    std::vector<uint8_t> want;
    for (float x : xs) {
      const double a = std::fabs(double(x));
      size_t best = 0;  // the nearest magnitude; ties to the larger
      for (size_t c = 1; c < mag.size(); ++c)
        if (std::fabs(mag[c] - a) <= std::fabs(mag[best] - a)) best = c;
      want.push_back(uint8_t(best | (is_signed && x < 0 && best > 0 ? 0x80 : 0)));
    }
    for (const std::vector<uint8_t>& got : codes_of(xs, is_signed))
      for (size_t k = 0; k < xs.size(); ++k)
        ASSERT_EQ(int(got[k]), int(want[k])) << "x=" << xs[k] << " signed=" << is_signed;
    // NaN saturates at the largest code, on every ISA alike.
    for (const std::vector<uint8_t>& got :
         codes_of({std::numeric_limits<float>::quiet_NaN()}, is_signed))
      EXPECT_EQ(int(got[0]), is_signed ? 127 : 255);
  }
}

// What the tests above leave to the scalar tail, in vector lanes of every ISA: NaN of either sign
// (the largest code, without a sign), ±0, denormals, ±1 and the floats around the smallest
// point's half; in a block with 1.0 in it, so x × (1 / 1) = x. And a block whose absmax is a
// denormal, whose 1 / absmax overflows: its values are divided by the absmax instead (its zeros
// stay 0); and one with ±inf.
TEST(StateFormats, SpecialValuesEncodeAlikeInEveryLane) {
  using L = std::numeric_limits<float>;
  const float half = std::bit_cast<float>(Q8Code<true>::kHalfMin);
  const float specials[] = {L::quiet_NaN(),
                            -L::quiet_NaN(),
                            0.0f,
                            -0.0f,
                            L::denorm_min(),
                            -L::denorm_min(),
                            L::min(),
                            -L::min(),
                            1.0f,
                            -1.0f,
                            std::nextafter(half, 0.0f),
                            half,
                            -half,
                            0.75f,
                            -0.3f};
  for (bool is_signed : {true, false}) {
    auto code = [&](float y) {
      const uint32_t b = std::bit_cast<uint32_t>(y);
      return is_signed ? Q8Code<true>::encode(b) : Q8Code<false>::encode(b);
    };
    std::vector<float> x{1.0f};
    for (int k = 0; k < 9; ++k) x.insert(x.end(), std::begin(specials), std::end(specials));
    const float d = L::denorm_min() * 1000.0f;  // a block whose 1 / absmax overflows
    const float five[] = {0.0f, d, -d / 3, d / 7, 0.0f};
    std::vector<float> tiny;
    for (int k = 0; k < 6; ++k) tiny.insert(tiny.end(), std::begin(five), std::end(five));
    const std::vector<float> infs{L::infinity(), -L::infinity(), 1.0f,  -2.0f, 0.0f, 3.0f,
                                  4.0f,          5.0f,           6.0f,  7.0f,  8.0f, 9.0f,
                                  10.0f,         11.0f,          12.0f, 13.0f, 14.0f};
    const std::vector<float>* blocks[] = {&x, &tiny, &infs};
    for (const std::vector<float>* block : blocks) {
      const int64_t n = int64_t(block->size());
      std::vector<uint8_t> want;
      const float am = block == &x ? 1.0f : block == &tiny ? d : L::infinity();
      for (float v : *block)
        if (std::isnan(v))  // the largest code, whatever the NaN's sign
          want.push_back(is_signed ? 127 : 255);
        else
          want.push_back(block == &tiny ? code(v / d)
                         : block == &x  ? code(v * 1.0f)
                                        : code(v * 0.0f));
      if (block == &tiny) {
        ASSERT_FALSE(1.0f / d <= L::max());  // the case it stands for
        EXPECT_EQ(want[0], 0);
      }
      for (Isa isa : kIsas) {
        if (!isa_supported(isa)) continue;
        std::vector<uint8_t> q(static_cast<size_t>(n));
        float a = -1.0f;
        quantize_blocks(isa, block->data(), n, n, is_signed, q.data(), &a);
        EXPECT_EQ(a, am) << isa_name(isa);
        for (int64_t i = 0; i < n; ++i)
          ASSERT_EQ(int(q[size_t(i)]), int(want[size_t(i)]))
              << isa_name(isa) << " x=" << (*block)[size_t(i)] << " at " << i;
      }
    }
  }
}

// Quantize and dequantize agree bitwise across ISAs, and the round trip is within half a step:
// |x - x'| <= |x| / 16, or below the smallest point, half of it (absmax × 2^-16 bounds both).
TEST(StateFormats, BlockQuantizationBitwiseAcrossIsas) {
  std::mt19937 rng(11);
  for (bool is_signed : {true, false}) {
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
          const double am = a_ref[size_t(i / block)], xi = x[size_t(i)];
          ASSERT_LE(std::abs(double(back_ref[size_t(i)]) - xi),
                    std::max(std::abs(xi) / 16, am * std::ldexp(1.0, -16)) * 1.0001)
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

// Every code, in every lane position, dequantizes to its point × absmax on every ISA.
TEST(StateFormats, EveryCodeDequantizesToItsPoint) {
  // Code i at position i % 64 and, shifted by one each round, at every other of the 64.
  const int64_t n = 256 * 65 + 7;
  std::vector<uint8_t> q(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) q[size_t(i)] = uint8_t((i + i / 256) % 256);
  const float absmax[] = {0.75f};
  for (bool is_signed : {true, false}) {
    for (Isa isa : kIsas) {
      if (!isa_supported(isa)) continue;
      std::vector<float> x(static_cast<size_t>(n));
      dequantize_blocks(isa, q.data(), absmax, n, n, is_signed, x.data());
      for (int64_t i = 0; i < n; ++i)
        ASSERT_EQ(std::bit_cast<uint32_t>(x[size_t(i)]),
                  std::bit_cast<uint32_t>(point(q[size_t(i)], is_signed) * 0.75f))
            << isa_name(isa) << " code " << int(q[size_t(i)]) << " at " << i;
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
    a1.assign(size_t(blocks), 0.0f);  // q8: all codes 0 are all zeros
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

// The same with moments that are not zero, in the gaps too: the codes and absmax of every
// touched block are the f32 update of the widened state, each segment with its own hyper and
// the gaps' elements as they were, requantized; bitwise the same on every ISA. A kernel that
// dropped a gap's elements, or took their old values out of the block's new absmax, would
// differ here (block 1's largest moments are a gap's).
TEST(StateFormats, SegmentsWithGapsAreTheDefinitionOnEveryIsa) {
  const int64_t n = 1024, block = 256;
  UpdateHyper h1 = hyper(OptimizerKind::adamw), h2 = hyper(OptimizerKind::adamw);
  h2.lr = 5e-2f;
  h2.beta1 = 0.5f;
  const UpdateSegment segs[] = {{0, 300, &h1}, {310, 1000, &h2}};
  std::vector<State> results;
  for (Isa isa : kIsas) {
    if (!isa_supported(isa)) continue;
    State st(StateFormat::q8, n, block, 21);
    optimizer_update(isa, h1, st.args());  // every element's moments nonzero
    // In block 1, a gap element (305) holds each moment's largest magnitude, about 10 (first
    // moment) and 100 (second) times the others' at most: the block's new absmax must come
    // from it.
    st.a0[1] *= 100.0f;
    st.a1[1] *= 100.0f;
    for (int64_t i = 256; i < 512; ++i) {
      st.s0[size_t(i)] =
          uint8_t(std::min(st.s0[size_t(i)] & 0x7F, 100) | (st.s0[size_t(i)] & 0x80));
      st.s1[size_t(i)] = std::min<uint8_t>(st.s1[size_t(i)], 200);
    }
    st.s0[305] = 0x80 | 127;
    st.s1[305] = 255;
    // The reference: the widened state, updated in f32 per segment.
    State f32(StateFormat::f32, n, block, 21);
    f32.master = st.master;
    const std::vector<float> m = st.moment(0), v = st.moment(1);
    std::memcpy(f32.s0.data(), m.data(), size_t(n) * 4);
    std::memcpy(f32.s1.data(), v.data(), size_t(n) * 4);
    for (const UpdateSegment& g : segs) {
      UpdateArgs a = f32.args();
      a.master = static_cast<float*>(a.master) + g.begin;
      a.state0 = static_cast<float*>(a.state0) + g.begin;
      a.state1 = static_cast<float*>(a.state1) + g.begin;
      a.grad = static_cast<const uint16_t*>(a.grad) + g.begin;
      a.out = static_cast<uint16_t*>(a.out) + g.begin;
      a.n = g.end - g.begin;
      optimizer_update(Isa::scalar, *g.h, a);
    }
    optimizer_update_segments(isa, segs, 2, st.args());
    ASSERT_EQ(0, std::memcmp(st.master.data(), f32.master.data(), size_t(n) * 4)) << isa_name(isa);
    for (int which = 0; which < 2; ++which) {
      std::vector<uint8_t> q(static_cast<size_t>(n));
      std::vector<float> a(static_cast<size_t>(n / block));
      quantize_blocks(Isa::scalar, f32.moment(which).data(), n, block, which == 0, q.data(),
                      a.data());
      ASSERT_TRUE(std::equal(q.begin(), q.end(), (which == 0 ? st.s0 : st.s1).begin()))
          << isa_name(isa) << " moment " << which;
      ASSERT_EQ(a, which == 0 ? st.a0 : st.a1) << isa_name(isa);
      const std::vector<float> w = st.moment(which);
      ASSERT_EQ(std::abs(w[305]), (which == 0 ? st.a0 : st.a1)[1]);  // the gap held the max
    }
    results.push_back(st);
  }
  for (const State& r : results) EXPECT_TRUE(r == results[0]);
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
// would change them (codes whose largest magnitude is not 1.0 would come back with another
// absmax).
TEST(StateFormats, BlocksNoSegmentTouchesStayAsTheyAre) {
  const int64_t n = 1024, block = 256;
  const UpdateHyper h = hyper(OptimizerKind::adamw);
  State st(StateFormat::q8, n, block, 4);
  float largest = 0.0f;
  for (int64_t i = 512; i < n; ++i) {
    st.s0[size_t(i)] = uint8_t(i % 100);  // no code of 1.0 (127)
    largest = std::max(largest, std::fabs(point(st.s0[size_t(i)], true) * 0.5f));
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
// for bit, on every ISA, blocks whose largest magnitude is negative included (they must occur
// here, or the test would not cover them).
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
      for (int64_t i = b; i < b + block; ++i)
        if (std::abs(x[size_t(i)]) > std::abs(m)) m = x[size_t(i)];
      negative_max += m < 0;
      ASSERT_EQ(std::abs(m), a_ref[size_t(b / block)]);  // 1.0 is a point: max |x| is the absmax
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
