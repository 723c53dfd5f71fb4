#pragma once
// The one-lane "vector" type: the reference ISA, and the tail loop of every wider ISA. The
// shared templates (update_impl.hpp, elementwise_impl.hpp) only see this interface:
//   T             lane type; + - * / on T are IEEE single-precision per lane
//   kWidth        lanes per T
//   set1, load_f32/store_f32, load_bf16/store_bf16, load_f16/store_f16   (unaligned)
//   sqrt, sign    IEEE sqrt; sign(c) = +1 / -1 / +0 for c = ±0 / NaN for NaN
//   round_bf16_sr lane j stochastically rounded to bf16 with the rounding bits of element
//                 index + j under key (scalar_convert.hpp), the result as f32
//   zero, bit_xor same_bytes' data movement (bitwise, no arithmetic)
//   Acc, acc_zero, acc_add_square, acc_total   double accumulation for sum_squares
//   decode8<S>    q8: the points of kWidth codes q (quant_code.hpp, S: signed) × absmax
//   encode8<S>    q8: stores the code of each lane's value (already divided by its absmax)
//   abs, max, reduce_max   |x|; max(a, b) = a > b ? a : b (so NaN in a gives b); max of lanes
// Anonymous namespace: see scalar_convert.hpp (each ISA file gets its own copy).

#include <bit>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "kernels/cpu/quant_code.hpp"
#include "kernels/cpu/scalar_convert.hpp"

namespace zeroshard::cpu {
namespace {

struct ScalarVec {
  using T = float;
  using Acc = double;
  static constexpr int64_t kWidth = 1;

  static T set1(float x) { return x; }
  static T load_f32(const float* p) { return *p; }
  static void store_f32(float* p, T x) { *p = x; }
  static T load_bf16(const uint16_t* p) { return cvt::bf16_to_float(*p); }
  static void store_bf16(uint16_t* p, T x) { *p = cvt::float_to_bf16(x); }
  static T load_f16(const uint16_t* p) { return cvt::f16_to_float(*p); }
  static void store_f16(uint16_t* p, T x) { *p = cvt::float_to_f16(x); }

  static T sqrt(T x) { return std::sqrt(x); }
  // c - c is +0 for c = ±0 and NaN for NaN, so a NaN momentum poisons p as torch.sign would.
  static T sign(T c) { return c > 0.0f ? 1.0f : (c < 0.0f ? -1.0f : c - c); }

  static T round_bf16_sr(T x, uint32_t key, uint32_t index) {
    return cvt::round_bf16_stochastic(x, cvt::rounding_bits(key, index));
  }

  static T zero() { return 0.0f; }
  static T bit_xor(T a, T b) {
    return std::bit_cast<float>(std::bit_cast<uint32_t>(a) ^ std::bit_cast<uint32_t>(b));
  }

  static Acc acc_zero() { return 0.0; }
  // A float's square is exact in double (24 + 24 bits < 53), so only the sum rounds.
  static Acc acc_add_square(Acc acc, T x) {
    const double d = x;
    return acc + d * d;
  }
  static double acc_total(Acc acc) { return acc; }

  template <bool S>
  static T decode8(const uint8_t* q, T absmax) {
    return std::bit_cast<float>(Q8Code<S>::point_bits(*q)) * absmax;
  }
  static T abs(T x) { return std::bit_cast<float>(std::bit_cast<uint32_t>(x) & 0x7FFFFFFFu); }
  static T max(T a, T b) { return a > b ? a : b; }
  static float reduce_max(T x) { return x; }
  template <bool S>
  static void encode8(T x, uint8_t* q) {
    *q = Q8Code<S>::encode(std::bit_cast<uint32_t>(x));
  }
};

// Runs body.template operator()<U>(begin, end) over [0, n): full vectors with V, then the tail
// with ScalarVec (skipped when V is the scalar type itself).
template <class V, class Body>
inline void split_tail(int64_t n, Body&& body) {
  const int64_t full = n - n % V::kWidth;
  body.template operator()<V>(int64_t{0}, full);
  if constexpr (!std::is_same_v<V, ScalarVec>) body.template operator()<ScalarVec>(full, n);
}

}  // namespace
}  // namespace zeroshard::cpu
