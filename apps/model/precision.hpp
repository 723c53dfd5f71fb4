#pragma once
// The demo computes in f32; the engine may hold parameters and gradients in bf16 or f16. These
// conversions round to nearest even, as the engine's own kernels do, so a gradient written here
// and a parameter rounded by the engine see the same rounding rule. Written with integer
// operations only, so they do not depend on the compiler's _Float16 support or the FPU mode.

#include <bit>
#include <cstdint>

#include "zeroshard/types.hpp"

namespace zsdemo {

inline float bf16_to_f32(uint16_t h) {
  return std::bit_cast<float>(uint32_t{h} << 16);
}

inline uint16_t f32_to_bf16(float f) {
  const uint32_t u = std::bit_cast<uint32_t>(f);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((u >> 16) | 0x0040u);  // NaN
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

inline float f16_to_f32(uint16_t h) {
  const uint32_t sign = uint32_t{h & 0x8000u} << 16;
  const uint32_t exp = (h >> 10) & 0x1Fu, mant = h & 0x3FFu;
  if (exp == 0x1F) return std::bit_cast<float>(sign | 0x7F800000u | (mant << 13));
  if (exp != 0) return std::bit_cast<float>(sign | ((exp + 112u) << 23) | (mant << 13));
  // Subnormal (or zero): its value is mant · 2^-24, exact in f32.
  const float v = static_cast<float>(mant) * (1.0f / 16777216.0f);
  return sign ? -v : v;
}

inline uint16_t f32_to_f16(float f) {
  const uint32_t u = std::bit_cast<uint32_t>(f);
  const uint32_t sign = (u >> 16) & 0x8000u, a = u & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return static_cast<uint16_t>(sign | 0x7E00u);   // NaN
  if (a >= 0x477FF000u) return static_cast<uint16_t>(sign | 0x7C00u);  // rounds to inf
  if (a >= 0x38800000u) {  // normal: rebias, round the 13 dropped bits to nearest even
    const uint32_t r = a - (112u << 23);
    return static_cast<uint16_t>(sign | ((r + 0xFFFu + ((r >> 13) & 1u)) >> 13));
  }
  // Subnormal or zero: the value in units of 2^-24, rounded to nearest even by the FPU (the
  // product is exact and the default rounding mode is nearest-even).
  const float scaled = std::bit_cast<float>(a) * 16777216.0f;
  uint32_t m = static_cast<uint32_t>(scaled);
  const float rest = scaled - static_cast<float>(m);
  if (rest > 0.5f || (rest == 0.5f && (m & 1u))) ++m;
  return static_cast<uint16_t>(sign | m);
}

/// dst[i] = float(src[i]) for n elements of `dtype`.
inline void to_f32(const void* src, zeroshard::DType dtype, float* dst, int64_t n) {
  using zeroshard::DType;
  const auto* h = static_cast<const uint16_t*>(src);
  switch (dtype) {
    case DType::f32:
      for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<const float*>(src)[i];
      break;
    case DType::bf16:
      for (int64_t i = 0; i < n; ++i) dst[i] = bf16_to_f32(h[i]);
      break;
    case DType::f16:
      for (int64_t i = 0; i < n; ++i) dst[i] = f16_to_f32(h[i]);
      break;
  }
}

/// dst[i] = convert(src[i]) for n elements, rounding to nearest even.
inline void from_f32(const float* src, void* dst, zeroshard::DType dtype, int64_t n) {
  using zeroshard::DType;
  auto* h = static_cast<uint16_t*>(dst);
  switch (dtype) {
    case DType::f32:
      for (int64_t i = 0; i < n; ++i) static_cast<float*>(dst)[i] = src[i];
      break;
    case DType::bf16:
      for (int64_t i = 0; i < n; ++i) h[i] = f32_to_bf16(src[i]);
      break;
    case DType::f16:
      for (int64_t i = 0; i < n; ++i) h[i] = f32_to_f16(src[i]);
      break;
  }
}

}  // namespace zsdemo
