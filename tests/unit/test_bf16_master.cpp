// The bf16 master (Config::bf16_master): stochastic rounding on its own (one of the two bf16
// neighbours, up with the probability of the dropped fraction, specials kept), the update
// against its definition (the f32 update of the widened master, then that rounding with the
// bits of the element's index in its unit), bitwise on every ISA, and the reason for it: many
// updates below half a bf16 ulp move the weight as f32 would, where rounding to nearest stalls.

#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "kernels/cpu/cpu_kernels.hpp"
#include "kernels/cpu/scalar_convert.hpp"
#include "zeroshard/error.hpp"

namespace zeroshard::cpu {
namespace {

uint32_t bits(float x) {
  return std::bit_cast<uint32_t>(x);
}
float from_bits(uint32_t u) {
  return std::bit_cast<float>(u);
}

TEST(BF16Master, RoundsToANeighbourWithTheDroppedFractionsProbability) {
  // 1 + 0.3 ulp, −3 − 0.75 ulp, a subnormal-range value: each rounds up in magnitude with the
  // probability of its dropped fraction (65536 draws: binomial σ ≤ 0.002).
  for (const uint32_t lo : {0x3F800000u, 0xC0400000u, 0x00050000u}) {
    for (const uint32_t frac : {0x4CCCu, 0xC000u, 0x0001u}) {
      const float x = from_bits(lo + frac);
      int up = 0;
      for (uint32_t i = 0; i < 65536; ++i) {
        const uint32_t r = bits(cvt::round_bf16_stochastic(x, cvt::rounding_bits(12345u, i)));
        ASSERT_TRUE(r == lo || r == lo + 0x10000u) << std::hex << r;
        up += r != lo;
      }
      EXPECT_NEAR(up / 65536.0, frac / 65536.0, 0.01) << std::hex << lo << " " << frac;
    }
  }
  // The same element over many steps (keys) rounds up as often: no element is stuck.
  const float x = from_bits(0x3F804000u);  // 1 + 1/4 ulp
  int up = 0;
  for (int64_t step = 0; step < 20000; ++step)
    up += bits(cvt::round_bf16_stochastic(x, cvt::rounding_bits(rounding_key(step, 7), 3))) !=
          0x3F800000u;
  EXPECT_NEAR(up / 20000.0, 0.25, 0.015);
}

TEST(BF16Master, KeepsBF16ValuesAndSpecials) {
  for (const uint32_t v : {0x3F800000u, 0x00000000u, 0x80000000u, 0xC2F70000u, 0x7F800000u,
                           0xFF800000u, 0x7F7F0000u}) {
    for (uint32_t i = 0; i < 1000; ++i)
      ASSERT_EQ(bits(cvt::round_bf16_stochastic(from_bits(v), cvt::rounding_bits(9u, i))), v);
  }
  for (uint32_t i = 0; i < 1000; ++i) {
    const float nan = cvt::round_bf16_stochastic(from_bits(0x7FFFFFFFu), cvt::rounding_bits(9u, i));
    ASSERT_TRUE(std::isnan(nan));
    ASSERT_EQ(cvt::float_to_bf16(nan) & 0x7FC0u, 0x7FC0u);  // stored as a quiet NaN
  }
}

TEST(BF16Master, KeysDifferPerStepAndUnit) {
  EXPECT_NE(rounding_key(0, 0), rounding_key(1, 0));
  EXPECT_NE(rounding_key(0, 0), rounding_key(0, 1));
  EXPECT_NE(rounding_key(int64_t(1) << 32, 0), rounding_key(0, 0));
  EXPECT_EQ(rounding_key(41, 3), rounding_key(41, 3));
}

struct Arrays {
  std::vector<uint16_t> master, out;
  std::vector<float> s0, s1;
  std::vector<uint16_t> s0h, s1h;  // bf16 moments
  std::vector<float> grad;
  Arrays(int64_t n, uint32_t seed) : out(size_t(n), 0xFFFF), grad(size_t(n)) {
    std::mt19937 rng(seed);
    std::uniform_real_distribution<float> p(-2, 2), m(-0.1f, 0.1f), v(0, 0.01f), g(-1, 1);
    for (int64_t i = 0; i < n; ++i) {
      master.push_back(cvt::float_to_bf16(p(rng)));
      s0.push_back(m(rng));
      s1.push_back(v(rng));
      s0h.push_back(cvt::float_to_bf16(s0.back()));
      s1h.push_back(cvt::float_to_bf16(s1.back()));
      grad[size_t(i)] = g(rng);
    }
  }
  UpdateArgs args(bool bf16_state, bool with_out, uint32_t key, int64_t index) {
    UpdateArgs a;
    a.master = master.data();
    a.master_dtype = DType::bf16;
    a.round_key = key;
    a.index = index;
    a.state0 = bf16_state ? static_cast<void*>(s0h.data()) : s0.data();
    a.state1 = bf16_state ? static_cast<void*>(s1h.data()) : s1.data();
    a.state_format = bf16_state ? StateFormat::bf16 : StateFormat::f32;
    a.grad = grad.data();
    a.grad_dtype = DType::f32;
    a.out = with_out ? out.data() : nullptr;
    a.out_dtype = DType::bf16;
    a.n = int64_t(master.size());
    return a;
  }
};

UpdateHyper adamw() {
  UpdateHyper h;
  h.kind = OptimizerKind::adamw;
  h.lr = 1e-3f;
  h.beta1 = 0.9f;
  h.beta2 = 0.999f;
  h.eps = 1e-8f;
  h.weight_decay = 0.1f;
  h.bias_correction1 = 0.1f;
  h.bias_correction2 = 0.001f;
  return h;
}

// The definition, element by element: the f32 master path of the scalar kernel on the widened
// master, then the rounding of element index + i; the copy-out is the master's bits.
TEST(BF16Master, UpdateIsTheF32UpdateThenStochasticRounding) {
  const int64_t n = 1000, index = (int64_t(1) << 32) - 300;  // the index wraps modulo 2^32
  const uint32_t key = rounding_key(17, 2);
  Arrays got(n, 5);
  std::vector<float> wide(static_cast<size_t>(n)), s0 = got.s0, s1 = got.s1;
  for (int64_t i = 0; i < n; ++i) wide[size_t(i)] = cvt::bf16_to_float(got.master[size_t(i)]);
  UpdateArgs ref;
  ref.master = wide.data();
  ref.state0 = s0.data();
  ref.state1 = s1.data();
  ref.grad = got.grad.data();
  ref.n = n;
  optimizer_update(Isa::scalar, adamw(), ref);
  optimizer_update(Isa::scalar, adamw(), got.args(false, true, key, index));
  int other_way = 0;
  for (int64_t i = 0; i < n; ++i) {
    const float want =
        cvt::round_bf16_stochastic(wide[size_t(i)], cvt::rounding_bits(key, uint32_t(index + i)));
    ASSERT_EQ(uint32_t(got.master[size_t(i)]) << 16, bits(want)) << i;
    ASSERT_EQ(got.out[size_t(i)], got.master[size_t(i)]) << i;
    ASSERT_EQ(bits(got.s0[size_t(i)]), bits(s0[size_t(i)])) << i;
    other_way += cvt::float_to_bf16(wide[size_t(i)]) != got.master[size_t(i)];
  }
  // Not rounding to nearest in disguise: some elements went the other way (few, since each
  // update is a small part of an ulp and lands near the value it left; nearest would give 0).
  EXPECT_GT(other_way, n / 20);
}

class BF16MasterIsa : public ::testing::TestWithParam<Isa> {
 protected:
  void SetUp() override {
    if (!isa_supported(GetParam()))
      GTEST_SKIP() << "this CPU lacks " << isa_name(GetParam()) << "; nothing to compare";
  }
};

// Every ISA's vector hash and rounding equal the scalar reference's, with f32 and bf16 moments,
// with and without the copy-out, over every tail length, at an index that wraps.
TEST_P(BF16MasterIsa, BitwiseEqualsScalar) {
  for (bool bf16_state : {false, true})
    for (bool with_out : {false, true})
      for (int64_t n : {1, 7, 8, 15, 16, 17, 31, 33, 100, 1000}) {
        Arrays ref(n, uint32_t(n)), got(n, uint32_t(n));
        for (int64_t step = 1; step <= 3; ++step) {
          const uint32_t key = rounding_key(step, 0);
          const int64_t index = (int64_t(1) << 32) - 5;
          optimizer_update(Isa::scalar, adamw(), ref.args(bf16_state, with_out, key, index));
          optimizer_update(GetParam(), adamw(), got.args(bf16_state, with_out, key, index));
        }
        const std::string what =
            "n=" + std::to_string(n) + (bf16_state ? " bf16 state" : "") + (with_out ? " out" : "");
        ASSERT_EQ(ref.master, got.master) << what;
        ASSERT_EQ(ref.out, got.out) << what;
        ASSERT_EQ(ref.s0h, got.s0h) << what;
        ASSERT_EQ(0, std::memcmp(ref.s1.data(), got.s1.data(), size_t(n) * 4)) << what;
      }
}

INSTANTIATE_TEST_SUITE_P(Isas, BF16MasterIsa,
                         ::testing::Values(Isa::scalar, Isa::avx2, Isa::avx512),
                         [](const auto& i) { return std::string(isa_name(i.param)); });

// Why: SGD steps of 1e-4 on weights of 1, a 78th of a bf16 ulp (2^-7). Rounding to nearest loses
// every one of them; stochastic rounding moves the weights as f32 does on average.
TEST(BF16Master, SmallUpdatesAccumulateAsInF32) {
  const int64_t n = 4096;
  std::vector<uint16_t> master(size_t(n), cvt::float_to_bf16(1.0f));
  const std::vector<float> grad(size_t(n), 1.0f);
  UpdateHyper h;
  h.kind = OptimizerKind::sgd;
  h.lr = 1e-4f;
  for (int64_t step = 0; step < 1000; ++step) {
    UpdateArgs a;
    a.master = master.data();
    a.master_dtype = DType::bf16;
    a.round_key = rounding_key(step, 0);
    a.grad = grad.data();
    a.n = n;
    optimizer_update(best_isa(), h, a);
  }
  double mean = 0;
  for (uint16_t m : master) mean += cvt::bf16_to_float(m);
  mean /= double(n);
  EXPECT_NEAR(mean, 1.0 - 1000 * 1e-4, 2e-3);  // 0.9; σ of the mean ≈ 1e-4
  EXPECT_EQ(cvt::float_to_bf16(1.0f - 1e-4f), cvt::float_to_bf16(1.0f));  // nearest: stuck
}

TEST(BF16Master, RefusesCombinationsItDoesNotKeep) {
  Arrays a(16, 1);
  UpdateArgs args = a.args(false, true, 0, 0);
  args.out_dtype = DType::f32;
  EXPECT_THROW(optimizer_update(Isa::scalar, adamw(), args), Error);
  args = a.args(false, false, 0, 0);
  args.grad_dtype = DType::f16;
  EXPECT_THROW(optimizer_update(Isa::scalar, adamw(), args), Error);
  args = a.args(false, false, 0, 0);
  args.master_dtype = DType::f16;
  EXPECT_THROW(optimizer_update(Isa::scalar, adamw(), args), Error);
}

}  // namespace
}  // namespace zeroshard::cpu
