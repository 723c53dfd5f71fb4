#pragma once
// The 8-bit code of StateFormat::q8: small floating-point numbers, scaled per block. A block's
// values are divided by its absmax (max |x|), so they lie in [-1, 1], and each is stored as the
// nearest of its code's points, ties to the larger magnitude:
//   signed (first moments, momentum): a sign bit (bit 7) and a 7-bit magnitude code, the range
//     of 4 exponent bits and the precision of 3 mantissa bits; 255 points from -1 to 1;
//   unsigned (Adam's second moment): an 8-bit magnitude code, 5 exponent bits' range and 3
//     mantissa bits' precision; 256 points from 0 to 1.
// Not FP8's E4M3 / E5M2 bytes: the largest code is 1.0 and there are no subnormals.
// Magnitude code c ≥ 1 stands for the f32 whose bit pattern is (c + kOff) << 20, so that the
// largest code is exactly 1.0 (an absmax comes back exactly) and each binade holds 8 points;
// c = 0 is 0. The smallest points are 1.25 · 2^-16 (signed) and 1.25 · 2^-32 (unsigned): the
// second moment, the square of a gradient, gets twice the first's range in exponents, and both
// the same relative step (1/8 of a binade: at most 6.25 % from a value to its point).
//
// Finding the nearest point is integer work on the f32 pattern of |x|: inside a binade the points
// are evenly spaced, so adding half a step (2^19) to the pattern and dropping the low 20 bits
// rounds to the nearest, ties up, across binade boundaries too. Magnitudes below the smallest
// point's half go to 0, those from it to code 1; 1.0 and ±inf saturate at the largest code, and
// so does NaN, without its sign (x86 and CUDA make NaNs of different signs). Dequantizing is the
// shift back and one multiply by the absmax. The same functions run in every ISA's lanes
// (scalar_vec.hpp, avx2.cpp, avx512.cpp) and in the CUDA kernel (kernels/cuda/update_q8.cu), so
// every backend stores the same codes.

#include <cstdint>

#if defined(__CUDACC__)
#define ZS_QUANT_HD __host__ __device__
#else
#define ZS_QUANT_HD
#endif

namespace zeroshard::cpu {

/// The code of 0 in both codes: fresh q8 moments are all zero bytes.
inline constexpr uint8_t kQ8Zero = 0;

template <bool Signed>
struct Q8Code {
  /// The largest magnitude code: 1.0.
  static constexpr uint32_t kMax = Signed ? 127 : 255;
  /// The pattern of code c is (c + kOff) << 20; 0x3F8 << 20 is 1.0f.
  static constexpr uint32_t kOff = 0x3F8 - kMax;
  /// The pattern of half the smallest point: magnitudes from it up take at least code 1.
  static constexpr uint32_t kHalfMin = ((1 + kOff) << 20) - (1u << 23);

  /// The code of the f32 with pattern `bits` (x already divided by its block's absmax).
  ZS_QUANT_HD static uint8_t encode(uint32_t bits) {
    const uint32_t mag = bits & 0x7FFFFFFFu;
    int32_t c = int32_t((mag + (1u << 19)) >> 20) - int32_t(kOff);
    c = c < 0 ? 0 : (c > int32_t(kMax) ? int32_t(kMax) : c);
    if (c == 0 && mag >= kHalfMin) c = 1;
    if (Signed && c > 0 && mag <= 0x7F800000u) c |= int32_t(bits >> 31) << 7;  // NaN: no sign
    return uint8_t(c);
  }
  /// The f32 pattern of code q's point (0 for the codes of 0).
  ZS_QUANT_HD static uint32_t point_bits(uint8_t q) {
    const uint32_t c = Signed ? (q & 0x7Fu) : q;
    if (c == 0) return 0;
    return ((c + kOff) << 20) | (Signed ? uint32_t(q >> 7) << 31 : 0u);
  }
};

}  // namespace zeroshard::cpu
