#pragma once
// Typed loads and stores over any vector type V (see scalar_vec.hpp), and the switch that turns
// a run-time DType into a compile-time one so each dtype combination gets its own tight loop.

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "kernels/cpu/update_rules.hpp"
#include "zeroshard/types.hpp"

namespace zeroshard::cpu {
namespace {

/// Loads V::kWidth elements of dtype D starting at element i of `base`, widened to f32.
template <class V, DType D>
inline typename V::T load_as(const void* base, int64_t i) {
  if constexpr (D == DType::f32) {
    return V::load_f32(static_cast<const float*>(base) + i);
  } else if constexpr (D == DType::bf16) {
    return V::load_bf16(static_cast<const uint16_t*>(base) + i);
  } else {
    return V::load_f16(static_cast<const uint16_t*>(base) + i);
  }
}

/// Stores V::kWidth f32 lanes as dtype D (round to nearest even) at element i of `base`.
template <class V, DType D>
inline void store_as(void* base, int64_t i, typename V::T x) {
  if constexpr (D == DType::f32) {
    V::store_f32(static_cast<float*>(base) + i, x);
  } else if constexpr (D == DType::bf16) {
    V::store_bf16(static_cast<uint16_t*>(base) + i, x);
  } else {
    V::store_f16(static_cast<uint16_t*>(base) + i, x);
  }
}

/// Software prefetch distance in elements (f32: 2 KiB ahead). The hardware streamer alone
/// leaves one core short of the bandwidth it could use once the loop carries real arithmetic;
/// prefetching every stream this far ahead keeps enough cache-line misses in flight. The
/// same-bytes reference prefetches the same way, so the comparison stays like for like.
inline constexpr int64_t kPrefetchElems = 512;
/// f32 elements per 64-byte cache line: loops prefetch once per line, not once per vector.
inline constexpr int64_t kLineElems = 16;

/// Prefetches element i + kPrefetchElems of `base` (elements of `elem_bytes`). The address is
/// formed as an integer: it may lie past the end of the array, which a prefetch tolerates but
/// pointer arithmetic would not.
inline void prefetch_ahead(const void* base, int64_t i, size_t elem_bytes) {
  const uintptr_t addr =
      reinterpret_cast<uintptr_t>(base) + static_cast<uintptr_t>(i + kPrefetchElems) * elem_bytes;
  __builtin_prefetch(reinterpret_cast<const void*>(addr), 0, 3);
}

}  // namespace
}  // namespace zeroshard::cpu
