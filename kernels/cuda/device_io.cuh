#pragma once
// Device-side loads, stores and conversions shared by the CUDA kernels. Eight elements travel
// together: 32 bytes of f32 as two float4, or 16 bytes of bf16/f16 as one uint4, so every
// global access is a full 16-byte vector. Conversions match kernels/cpu/scalar_convert.hpp bit
// for bit on every non-NaN value: widening is exact, narrowing rounds to nearest even and keeps
// subnormals (nvcc's default -ftz=false; the narrowing intrinsics carry no .ftz).

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "zeroshard/types.hpp"

namespace zeroshard::cuda::dev {

inline constexpr int kVec = 8;  // elements per vector access

// bf16 → f32 is a shift (exact, NaN payload kept), exactly as the CPU reference does it.
__device__ __forceinline__ float bf16_bits_to_float(uint32_t h) {
  return __uint_as_float(h << 16);
}
__device__ __forceinline__ uint32_t float_to_bf16_bits(float x) {
  return __bfloat16_as_ushort(__float2bfloat16_rn(x));
}
__device__ __forceinline__ float f16_bits_to_float(uint32_t h) {
  return __half2float(__ushort_as_half(static_cast<unsigned short>(h)));
}
__device__ __forceinline__ uint32_t float_to_f16_bits(float x) {
  return __half_as_ushort(__float2half_rn(x));
}

template <DType D>
__device__ __forceinline__ float bits_to_float(uint32_t h) {
  if constexpr (D == DType::bf16)
    return bf16_bits_to_float(h);
  else
    return f16_bits_to_float(h);
}
template <DType D>
__device__ __forceinline__ uint32_t float_to_bits(float x) {
  if constexpr (D == DType::bf16)
    return float_to_bf16_bits(x);
  else
    return float_to_f16_bits(x);
}

// One element i of a typed array.
template <DType D>
__device__ __forceinline__ float load1(const void* base, int64_t i) {
  if constexpr (D == DType::f32) {
    return static_cast<const float*>(base)[i];
  } else {
    return bits_to_float<D>(static_cast<const uint16_t*>(base)[i]);
  }
}
template <DType D>
__device__ __forceinline__ void store1(void* base, int64_t i, float x) {
  if constexpr (D == DType::f32) {
    static_cast<float*>(base)[i] = x;
  } else {
    static_cast<uint16_t*>(base)[i] = static_cast<uint16_t>(float_to_bits<D>(x));
  }
}

// Elements [i, i + 8) of a typed array whose base is 16-byte aligned; i is a multiple of 8.
template <DType D>
__device__ __forceinline__ void load8(const void* base, int64_t i, float (&x)[kVec]) {
  if constexpr (D == DType::f32) {
    const float4* p = reinterpret_cast<const float4*>(static_cast<const float*>(base) + i);
    const float4 a = p[0], b = p[1];
    x[0] = a.x, x[1] = a.y, x[2] = a.z, x[3] = a.w;
    x[4] = b.x, x[5] = b.y, x[6] = b.z, x[7] = b.w;
  } else {
    // Little endian: the low half of each 32-bit word is the lower-indexed element.
    const uint4 u = *reinterpret_cast<const uint4*>(static_cast<const uint16_t*>(base) + i);
    const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      x[2 * k] = bits_to_float<D>(w[k] & 0xFFFFu);
      x[2 * k + 1] = bits_to_float<D>(w[k] >> 16);
    }
  }
}
template <DType D>
__device__ __forceinline__ void store8(void* base, int64_t i, const float (&x)[kVec]) {
  if constexpr (D == DType::f32) {
    float4* p = reinterpret_cast<float4*>(static_cast<float*>(base) + i);
    p[0] = make_float4(x[0], x[1], x[2], x[3]);
    p[1] = make_float4(x[4], x[5], x[6], x[7]);
  } else {
    uint32_t w[4];
#pragma unroll
    for (int k = 0; k < 4; ++k)
      w[k] = float_to_bits<D>(x[2 * k]) | (float_to_bits<D>(x[2 * k + 1]) << 16);
    *reinterpret_cast<uint4*>(static_cast<uint16_t*>(base) + i) =
        make_uint4(w[0], w[1], w[2], w[3]);
  }
}

// f32 arrays as plain float pointers (master weights and optimizer state).
__device__ __forceinline__ void load8f(const float* p, int64_t i, float (&x)[kVec]) {
  load8<DType::f32>(p, i, x);
}
__device__ __forceinline__ void store8f(float* p, int64_t i, const float (&x)[kVec]) {
  store8<DType::f32>(p, i, x);
}

}  // namespace zeroshard::cuda::dev
