#pragma once
// The 8-bit dynamic code of StateFormat::q8 (Dettmers et al., "8-bit Optimizers via Block-wise
// Quantization", the dynamic tree map with 7 decimal exponents), and the lookup that finds a
// value's nearest code point with two table reads and one compare, identically in every ISA.
//
// A value x (already divided by its block's absmax, so in [-1, 1]) quantizes to
//   q(x) = #{ i < 255 : mid[i] < x },   mid[i] = (code[i] + code[i+1]) / 2 in f32,
// the index of the nearest code point, ties going to the lower one. Rather than searching the
// 255 midpoints, the top 16 bits of x's f32 pattern (sign, exponent and 7 mantissa bits) pick a
// bucket in which at most one midpoint lies (checked when the table is built). One 32-bit entry
// per bucket holds q at the bucket's lower end and, where a midpoint lies inside, the low 16
// bits of its pattern (its top 16 are the bucket's): within a bucket, x > mid compares those
// low bits alone (reversed for negative x, whose order runs against their magnitude's). So a
// lookup is one table read and one integer compare. Magnitudes below 2^-24 share the first
// bucket (no code point lies below 2^-21), NaN lands in the last one; neither holds a midpoint.

#include <cstdint>

// The lookup runs in the CUDA kernels too (kernels/cuda/update_q8.cu), on a copy of the tables
// in device memory: the same code, so the same codes.
#if defined(__CUDACC__)
#define ZS_QUANT_HD __host__ __device__
#else
#define ZS_QUANT_HD
#endif

namespace zeroshard::cpu {

struct QuantCode {
  /// Sign, exponent and 7 mantissa bits: the key is the top 16 bits of the f32 pattern.
  static constexpr int kKeyShift = 16;
  static constexpr int32_t kMinKey = 103 << 7;  ///< magnitude keys below 2^-24 clamp here
  static constexpr int32_t kBuckets = (127 - 103) * 128 + 1;  ///< per sign, up to key(1.0)

  float code[256];  ///< ascending
  float mid[256];   ///< mid[i] between code[i] and code[i+1]; mid[255] = +inf
  /// Per bucket (positive keys, then negative): q at its lower end in bits 0–7, and in bits
  /// 8–23 the threshold t that x's low 16 bits (complemented when x < 0) must exceed for
  /// q + 1; t = 0xFFFF (never) where no midpoint lies in the bucket.
  uint32_t entry[2 * kBuckets];
  uint8_t zero;  ///< the index of 0.0
  /// Byte b of each code point's f32 pattern (little-endian) in plane[b]: the tables of a
  /// dequantizer that looks bytes up (AVX512-VBMI's vpermi2b) rather than floats.
  uint8_t plane[4][256];

  /// The bucket of x: kBuckets × sign + the clamped magnitude key.
  ZS_QUANT_HD static int32_t bucket(uint32_t bits) {
    int32_t mag = int32_t((bits & 0x7FFFFFFFu) >> kKeyShift) - kMinKey;
    mag = mag < 0 ? 0 : (mag > kBuckets - 1 ? kBuckets - 1 : mag);
    return int32_t(bits >> 31) * kBuckets + mag;
  }
  /// x's low 16 bits in the bucket's order: complemented when x is negative.
  ZS_QUANT_HD static uint32_t low_bits(uint32_t bits) {
    return (bits ^ uint32_t(int32_t(bits) >> 31)) & 0xFFFFu;
  }
  /// The index of x's nearest code point.
  ZS_QUANT_HD uint8_t lookup(uint32_t bits) const {
    const uint32_t e = entry[bucket(bits)];
    return uint8_t((e & 0xFFu) + (low_bits(bits) > (e >> 8) ? 1u : 0u));
  }
};

/// The signed map (first moments, momentum: values in [-1, 1], 0 and 1.0 included, -1.0 not)
/// or the unsigned one (Adam's second moment: [0, 1]). Built once, on first use.
const QuantCode& dynamic_code(bool is_signed);

}  // namespace zeroshard::cpu
