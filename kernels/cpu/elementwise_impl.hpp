#pragma once
// The element-wise kernels (convert, accumulate, add_into, sum_squares, same_bytes), written once
// for every vector type V like update_impl.hpp: V handles full vectors, ScalarVec the tail.

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>

#include "kernels/cpu/kernel_table.hpp"
#include "kernels/cpu/scalar_vec.hpp"
#include "kernels/cpu/vec_io.hpp"

namespace zeroshard::cpu {
namespace {

// Kept local: the kernels object library must not depend on the engine's dtype_size().
inline size_t elem_bytes(DType d) {
  return d == DType::f32 ? 4 : 2;
}

// Widen to f32, narrow with round to nearest even: the one conversion path every pair shares.
template <class V, DType S, DType D>
void convert_typed(const void* src, void* dst, int64_t n) {
  split_tail<V>(n, [&]<class U>(int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; i += U::kWidth) {
      store_as<U, D>(dst, i, load_as<U, S>(src, i));
    }
  });
}

template <class V>
void convert_impl(const void* src, DType src_dtype, void* dst, DType dst_dtype, int64_t n) {
  // Same dtype is a byte copy: it also keeps NaN payloads that a widen/narrow would quieten.
  if (src_dtype == dst_dtype) {
    if (n > 0) std::memcpy(dst, src, static_cast<size_t>(n) * elem_bytes(src_dtype));
    return;
  }
  with_dtype(src_dtype, [&](auto s) {
    with_dtype(dst_dtype, [&](auto d) {
      convert_typed<V, decltype(s)::value, decltype(d)::value>(src, dst, n);
    });
  });
}

// Gradient accumulation across micro-steps always sums in f32, whatever the gradient dtype.
template <class V, DType G>
void accumulate_typed(float* acc, const void* g, int64_t n) {
  split_tail<V>(n, [&]<class U>(int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; i += U::kWidth) {
      U::store_f32(acc + i, U::load_f32(acc + i) + load_as<U, G>(g, i));
    }
  });
}

template <class V>
void accumulate_impl(float* acc, const void* g, DType g_dtype, int64_t n) {
  with_dtype(g_dtype, [&](auto d) { accumulate_typed<V, decltype(d)::value>(acc, g, n); });
}

// One rounding per element, as a reduction over low-precision buffers on the wire would do.
template <class V, DType D>
void add_into_typed(void* inout, const void* in, int64_t n) {
  split_tail<V>(n, [&]<class U>(int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; i += U::kWidth) {
      store_as<U, D>(inout, i, load_as<U, D>(inout, i) + load_as<U, D>(in, i));
    }
  });
}

template <class V>
void add_into_impl(void* inout, const void* in, DType dtype, int64_t n) {
  with_dtype(dtype, [&](auto d) { add_into_typed<V, decltype(d)::value>(inout, in, n); });
}

// Each lane keeps its own double sum, so the order differs from the scalar reference. Sums are
// closed every kSumBlock elements into one running total: a float's square is exact in double,
// so the relative error stays below (kSumBlock / width + n / kSumBlock) * 2^-53, under the 1e-12
// that cpu_kernels.hpp promises up to n ~ 3e7 even in the worst case.
constexpr int64_t kSumBlock = 4096;

template <class V, DType D>
double sum_squares_typed(const void* x, int64_t n) {
  static_assert(kSumBlock % V::kWidth == 0);
  double total = 0.0;
  split_tail<V>(n, [&]<class U>(int64_t begin, int64_t end) {
    for (int64_t block = begin; block < end; block += kSumBlock) {
      const int64_t stop = std::min(end, block + kSumBlock);
      typename U::Acc acc = U::acc_zero();
      for (int64_t i = block; i < stop; i += U::kWidth) {
        acc = U::acc_add_square(acc, load_as<U, D>(x, i));
      }
      total += U::acc_total(acc);
    }
  });
  return total;
}

template <class V>
double sum_squares_impl(const void* x, DType dtype, int64_t n) {
  double total = 0.0;
  with_dtype(dtype, [&](auto d) { total = sum_squares_typed<V, decltype(d)::value>(x, n); });
  return total;
}

// same_bytes with R reads and W writes fixed at compile time, so the stream loops unroll and the
// kernel is as lean as the update it is the ceiling for. The reads are xor-ed into the value
// written, which keeps the compiler from dropping them and costs no memory traffic. Every
// distinct stream is prefetched exactly as the update prefetches its streams.
template <class V, int R, int W>
void same_bytes_fixed(const float* const* reads, float* const* writes, int64_t n) {
  std::array<const float*, R> rd{};
  std::array<float*, W> wr{};
  std::array<const float*, R + W> distinct{};
  int streams = 0;
  for (int r = 0; r < R; ++r) distinct[streams++] = rd[r] = reads[r];
  for (int w = 0; w < W; ++w) {
    wr[w] = writes[w];
    bool seen = false;
    for (int r = 0; r < R; ++r) seen = seen || rd[r] == wr[w];
    if (!seen) distinct[streams++] = wr[w];
  }
  split_tail<V>(n, [&]<class U>(int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; i += U::kWidth) {
      if (U::kWidth >= kLineElems || i % kLineElems == 0) {
        for (int s = 0; s < streams; ++s) prefetch_ahead(distinct[s], i, 4);
      }
      typename U::T x = U::zero();
      for (int r = 0; r < R; ++r) x = U::bit_xor(x, U::load_f32(rd[r] + i));
      for (int w = 0; w < W; ++w) U::store_f32(wr[w] + i, x);
    }
  });
}

// A constexpr grid of every (R, W) instantiation, indexed by the run-time stream counts.
using SameBytesFn = void (*)(const float* const*, float* const*, int64_t);
constexpr int kStreamChoices = kMaxSameBytesStreams + 1;

template <class V, int R, size_t... W>
constexpr std::array<SameBytesFn, kStreamChoices> same_bytes_row(std::index_sequence<W...>) {
  return {&same_bytes_fixed<V, R, static_cast<int>(W)>...};
}

template <class V, size_t... R>
constexpr std::array<std::array<SameBytesFn, kStreamChoices>, kStreamChoices> same_bytes_grid(
    std::index_sequence<R...>) {
  return {same_bytes_row<V, static_cast<int>(R)>(std::make_index_sequence<kStreamChoices>{})...};
}

template <class V>
void same_bytes_impl(const float* const* reads, int read_streams, float* const* writes,
                     int write_streams, int64_t n) {
  static constexpr auto grid = same_bytes_grid<V>(std::make_index_sequence<kStreamChoices>{});
  grid[read_streams][write_streams](reads, writes, n);
}

}  // namespace
}  // namespace zeroshard::cpu
