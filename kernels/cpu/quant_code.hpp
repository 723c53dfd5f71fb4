#pragma once
// The 8-bit dynamic code of StateFormat::q8 (Dettmers et al., "8-bit Optimizers via Block-wise
// Quantization", the dynamic tree map with 7 decimal exponents), and the lookup that finds a
// value's nearest code point with two table reads and one compare, identically in every ISA.
//
// A value x (already divided by its block's absmax, so in [-1, 1]) quantizes to
//   q(x) = #{ i < 255 : mid[i] < x },   mid[i] = (code[i] + code[i+1]) / 2 in f32,
// the index of the nearest code point, ties going to the lower one. Rather than searching the
// 255 midpoints, the top 16 bits of x's f32 pattern (sign, exponent and 7 mantissa bits) pick a
// bucket in which at most one midpoint lies (checked when the table is built); the bucket
// stores q at its lower end, so q(x) = lo + (x > mid[lo]), mid[lo] kept beside lo per bucket.
// Magnitudes below 2^-24 share the first bucket (no code point lies below 2^-21), NaN lands in the
// last one.

#include <cstdint>

namespace zeroshard::cpu {

struct QuantCode {
  /// Sign, exponent and 7 mantissa bits: the key is the top 16 bits of the f32 pattern.
  static constexpr int kKeyShift = 16;
  static constexpr int32_t kMinKey = 103 << 7;  ///< magnitude keys below 2^-24 clamp here
  static constexpr int32_t kBuckets = (127 - 103) * 128 + 1;  ///< per sign, up to key(1.0)

  float code[256];             ///< ascending
  float mid[256];              ///< mid[i] between code[i] and code[i+1]; mid[255] = +inf
  int32_t lo[2 * kBuckets];    ///< q at each bucket's lower end: positive keys, then negative
  float lo_mid[2 * kBuckets];  ///< mid[lo[k]]: both reads of a lookup index by the key, so a
                               ///< vector lookup issues its two gathers at once, not in a chain
  uint8_t zero;                ///< the index of 0.0

  /// The bucket of x: kBuckets × sign + the clamped magnitude key.
  static int32_t bucket(uint32_t bits) {
    int32_t mag = int32_t((bits & 0x7FFFFFFFu) >> kKeyShift) - kMinKey;
    mag = mag < 0 ? 0 : (mag > kBuckets - 1 ? kBuckets - 1 : mag);
    return int32_t(bits >> 31) * kBuckets + mag;
  }
};

/// The signed map (first moments, momentum: values in [-1, 1], 0 and 1.0 included, -1.0 not)
/// or the unsigned one (Adam's second moment: [0, 1]). Built once, on first use.
const QuantCode& dynamic_code(bool is_signed);

}  // namespace zeroshard::cpu
