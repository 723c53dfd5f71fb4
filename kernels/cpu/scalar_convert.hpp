#pragma once
// Bit-exact scalar conversions between f32 and bf16/f16: the reference every ISA variant must
// match. They are written with integer operations only, so they do not depend on the compiler's
// _Float16 support, on the FPU rounding mode or on FTZ/DAZ flags.
//
// Everything here sits in an anonymous namespace on purpose: this header is included by
// translation units compiled with different -m flags, and an inline function with external
// linkage would let the linker keep the AVX-512 copy for the scalar caller (an ODR violation that
// turns into SIGILL on older CPUs).

#include <bit>
#include <cstdint>

namespace zeroshard::cpu::cvt {
namespace {

inline float bf16_to_float(uint16_t h) {
  return std::bit_cast<float>(uint32_t{h} << 16);
}

inline uint16_t float_to_bf16(float f) {
  const uint32_t u = std::bit_cast<uint32_t>(f);
  // NaN: keep sign and top payload bits, force the quiet bit so truncation cannot make it inf.
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((u >> 16) | 0x0040u);
  // Round to nearest even: add 0x7FFF plus the lowest kept bit. Overflow carries into the
  // exponent and yields inf, which is the correctly rounded result.
  const uint32_t lsb = (u >> 16) & 1u;
  return static_cast<uint16_t>((u + 0x7FFFu + lsb) >> 16);
}

// Stochastic rounding to bf16 (a bf16 master, Config::bf16_master): the rounding bits of
// element `index` under `key`, a bijection of the index per key (so no two elements of one
// update share them), mixed by the "lowbias32" integer hash (C. Wellons, hash-prospector).
inline uint32_t rounding_bits(uint32_t key, uint32_t index) {
  uint32_t x = (index * 0x9E3779B1u) ^ key;
  x ^= x >> 16;
  x *= 0x7FEB352Du;
  x ^= x >> 15;
  x *= 0x846CA68Bu;
  x ^= x >> 16;
  return x;
}

// x rounded to a bf16 value (returned as the f32 with those bits): up in magnitude with
// probability (dropped bits) / 2^16, else down, by adding the low 16 random bits and
// truncating, so the rounding is unbiased: E[result] = x. inf stays inf; NaN is returned as it
// is (float_to_bf16 then quiets it); a value within 2^-9 relative of FLT_MAX may round to inf.
inline float round_bf16_stochastic(float x, uint32_t bits) {
  const uint32_t u = std::bit_cast<uint32_t>(x);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return x;
  return std::bit_cast<float>((u + (bits & 0xFFFFu)) & 0xFFFF0000u);
}

inline float f16_to_float(uint16_t h) {
  const uint32_t sign = uint32_t{h & 0x8000u} << 16;
  const uint32_t exp = (h >> 10) & 0x1Fu;
  const uint32_t mant = h & 0x3FFu;
  if (exp == 0x1F) {
    // inf stays inf; NaN keeps its payload and becomes quiet, as F16C's vcvtph2ps does.
    const uint32_t quiet = mant != 0 ? 0x00400000u : 0u;
    return std::bit_cast<float>(sign | 0x7F800000u | quiet | (mant << 13));
  }
  if (exp != 0) return std::bit_cast<float>(sign | ((exp + 112u) << 23) | (mant << 13));
  if (mant == 0) return std::bit_cast<float>(sign);
  // Subnormal: normalise the mantissa so that its leading one becomes the implicit bit.
  const int shift = std::countl_zero(mant) - 21;  // moves the leading one to bit 10
  const uint32_t norm = (mant << shift) & 0x3FFu;
  const uint32_t e = 113u - static_cast<uint32_t>(shift);
  return std::bit_cast<float>(sign | (e << 23) | (norm << 13));
}

inline uint16_t float_to_f16(float f) {
  const uint32_t u = std::bit_cast<uint32_t>(f);
  const uint32_t sign = (u >> 16) & 0x8000u;
  const uint32_t a = u & 0x7FFFFFFFu;
  // NaN: quiet bit set, top payload bits kept (what vcvtps2ph produces).
  if (a > 0x7F800000u) return static_cast<uint16_t>(sign | 0x7E00u | ((a >> 13) & 0x3FFu));
  // 65520 is the midpoint between 65504 (odd mantissa) and 65536: ties-to-even rounds it up.
  if (a >= 0x477FF000u) return static_cast<uint16_t>(sign | 0x7C00u);
  if (a >= 0x38800000u) {
    // Normal range: rebias the exponent, then round the 13 dropped bits to nearest even.
    const uint32_t r = a - (112u << 23);
    return static_cast<uint16_t>(sign | ((r + 0xFFFu + ((r >> 13) & 1u)) >> 13));
  }
  const uint32_t e = a >> 23;
  // Below 2^-25 everything rounds to zero (2^-25 itself is a tie that goes to even zero).
  if (e < 102) return static_cast<uint16_t>(sign);
  // Subnormal result: the value in units of 2^-24 is m >> shift, rounded to nearest even.
  const uint32_t m = (a & 0x7FFFFFu) | 0x800000u;
  const uint32_t shift = 126u - e;  // 14..24
  const uint32_t q = m >> shift;
  const uint32_t rem = m & ((1u << shift) - 1u);
  const uint32_t half = 1u << (shift - 1u);
  const uint32_t up = (rem > half || (rem == half && (q & 1u))) ? 1u : 0u;
  return static_cast<uint16_t>(sign | (q + up));
}

}  // namespace
}  // namespace zeroshard::cpu::cvt
