// Element-wise CUDA kernels: sum of squares with the overflow flag (one pass, deterministic),
// dtype casts and gradient accumulation. Each thread handles vectors of 8 consecutive elements;
// a vector is loaded with one or two 16-byte accesses when every pointer is 16-byte aligned and
// element by element otherwise. The order of arithmetic is the same on both paths, so alignment
// never changes a result.

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "base/cuda_check.hpp"
#include "kernels/cpu/update_rules.hpp"
#include "kernels/cuda/cuda_kernels.hpp"
#include "kernels/cuda/device_io.cuh"
#include "kernels/cuda/launch_math.hpp"

namespace zeroshard::cuda {
namespace {

using dev::kVec;

using launch::grid_for;
using launch::kMaxGrid;
using launch::kThreads;
using launch::vectors;
static_assert(launch::kVec == kVec);
// sum_squares' partials: one double and one flag per block, at most this many blocks.
constexpr int kSumBlocks = 1024;
static_assert(kSumBlocks * (sizeof(double) + sizeof(unsigned)) <= kSumSquaresWorkspaceBytes);

// Run-time dtypes become template arguments (one tight kernel per combination).
using cpu::with_dtype;

// The vector path needs every pointer 16-byte aligned; otherwise the same kernel loads scalars.
bool aligned16(const void* p) {
  return reinterpret_cast<uintptr_t>(p) % 16 == 0;
}

// Elements [8v, 8v + 8) of x, with zeros past n: one vector access when allowed, else scalars.
template <DType D, bool kAligned>
__device__ __forceinline__ void load_vector(const void* x, int64_t n, int64_t v,
                                            float (&out)[kVec]) {
  const int64_t i = v * kVec;
  if (kAligned && i + kVec <= n) {
    dev::load8<D>(x, i, out);
  } else {
#pragma unroll
    for (int k = 0; k < kVec; ++k) out[k] = i + k < n ? dev::load1<D>(x, i + k) : 0.0f;
  }
}

template <DType D, bool kAligned>
__device__ __forceinline__ void store_vector(void* x, int64_t n, int64_t v,
                                             const float (&in)[kVec]) {
  const int64_t i = v * kVec;
  if (kAligned && i + kVec <= n) {
    dev::store8<D>(x, i, in);
  } else {
#pragma unroll
    for (int k = 0; k < kVec; ++k)
      if (i + k < n) dev::store1<D>(x, i + k, in[k]);
  }
}

// ---- sum of squares + non-finite flag -------------------------------------------------------

__device__ __forceinline__ bool not_finite(float x) {
  return (__float_as_uint(x) & 0x7F800000u) == 0x7F800000u;
}

// Pass 1: thread t of block b sums the squares of vectors b*256 + t, + grid*256, ... in order
// (a float's square is exact in double, so only the additions round), then the block folds its
// 256 sums in a fixed tree. Zeros past n add nothing (x + 0 is x), so the tail is harmless.
template <DType D, bool kAligned>
__global__ void __launch_bounds__(kThreads)
    sum_squares_partial(const void* x, int64_t n, double* part, unsigned* flag) {
  __shared__ double sums[kThreads];
  __shared__ unsigned bad[kThreads];
  double acc = 0.0;
  unsigned nonfinite = 0;
  const int64_t vecs = vectors(n);
  const int64_t stride = launch::grid_stride(gridDim.x);
  for (int64_t v = launch::first_vector(blockIdx.x, threadIdx.x); v < vecs; v += stride) {
    float xs[kVec];
    load_vector<D, kAligned>(x, n, v, xs);
#pragma unroll
    for (int k = 0; k < kVec; ++k) {
      const double d = xs[k];
      acc = __dadd_rn(acc, __dmul_rn(d, d));
      nonfinite |= not_finite(xs[k]) ? 1u : 0u;
    }
  }
  sums[threadIdx.x] = acc;
  bad[threadIdx.x] = nonfinite;
  __syncthreads();
  for (int half = kThreads / 2; half > 0; half /= 2) {
    if (int(threadIdx.x) < half) {
      sums[threadIdx.x] = __dadd_rn(sums[threadIdx.x], sums[threadIdx.x + half]);
      bad[threadIdx.x] |= bad[threadIdx.x + half];
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    part[blockIdx.x] = sums[0];
    flag[blockIdx.x] = bad[0];
  }
}

// Pass 2, one block: partials in a fixed order (thread t takes t, t+256, ...; then a fixed
// tree), written as [sum, flag] or added to what `out` holds.
__global__ void __launch_bounds__(kThreads)
    sum_squares_final(const double* part, const unsigned* flag, int blocks, double* out,
                      bool accumulate) {
  __shared__ double sums[kThreads];
  __shared__ unsigned bad[kThreads];
  double acc = 0.0;
  unsigned nonfinite = 0;
  for (int b = int(threadIdx.x); b < blocks; b += kThreads) {
    acc = __dadd_rn(acc, part[b]);
    nonfinite |= flag[b];
  }
  sums[threadIdx.x] = acc;
  bad[threadIdx.x] = nonfinite;
  __syncthreads();
  for (int half = kThreads / 2; half > 0; half /= 2) {
    if (int(threadIdx.x) < half) {
      sums[threadIdx.x] = __dadd_rn(sums[threadIdx.x], sums[threadIdx.x + half]);
      bad[threadIdx.x] |= bad[threadIdx.x + half];
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    const bool any_bad = bad[0] != 0 || (accumulate && out[1] != 0.0);
    out[0] = accumulate ? __dadd_rn(out[0], sums[0]) : sums[0];
    out[1] = any_bad ? 1.0 : 0.0;
  }
}

// ---- convert and accumulate -------------------------------------------------------------------

template <DType S, DType D, bool kAligned>
__global__ void __launch_bounds__(kThreads) convert_kernel(const void* src, void* dst, int64_t n) {
  const int64_t vecs = vectors(n);
  const int64_t stride = launch::grid_stride(gridDim.x);
  for (int64_t v = launch::first_vector(blockIdx.x, threadIdx.x); v < vecs; v += stride) {
    float x[kVec];
    load_vector<S, kAligned>(src, n, v, x);
    store_vector<D, kAligned>(dst, n, v, x);
  }
}

template <DType G, bool kAligned>
__global__ void __launch_bounds__(kThreads)
    accumulate_kernel(float* acc, const void* g, int64_t n) {
  const int64_t vecs = vectors(n);
  const int64_t stride = launch::grid_stride(gridDim.x);
  for (int64_t v = launch::first_vector(blockIdx.x, threadIdx.x); v < vecs; v += stride) {
    float a[kVec], x[kVec];
    load_vector<DType::f32, kAligned>(acc, n, v, a);
    load_vector<G, kAligned>(g, n, v, x);
#pragma unroll
    for (int k = 0; k < kVec; ++k) a[k] = __fadd_rn(a[k], x[k]);
    store_vector<DType::f32, kAligned>(acc, n, v, a);
  }
}

size_t elem_bytes(DType d) {
  return d == DType::f32 ? 4 : 2;
}

}  // namespace

void sum_squares_nonfinite(const void* x, DType dtype, int64_t n, double* out, bool accumulate,
                           void* workspace, StreamHandle stream) {
  if (n < 0 || !out || !workspace || (n > 0 && !x))
    ZS_THROW(invalid_argument, "cuda::sum_squares_nonfinite: bad arguments (n = " << n << ")");
  auto s = static_cast<cudaStream_t>(stream);
  auto* part = static_cast<double*>(workspace);
  auto* flag = reinterpret_cast<unsigned*>(part + kSumBlocks);
  // The grid depends on n alone, which is what makes the summation order reproducible.
  const int blocks = n == 0 ? 0 : int(grid_for(vectors(n), kSumBlocks));
  if (blocks > 0) {
    with_dtype(dtype, [&](auto d) {
      if (aligned16(x)) {
        sum_squares_partial<decltype(d)::value, true><<<blocks, kThreads, 0, s>>>(x, n, part, flag);
      } else {
        sum_squares_partial<decltype(d)::value, false>
            <<<blocks, kThreads, 0, s>>>(x, n, part, flag);
      }
    });
    ZS_CUDA_CHECK_LAUNCH("cuda::sum_squares_nonfinite (pass 1, " << dtype_name(dtype) << ")");
  }
  // Always run pass 2, even for n = 0: it writes (or keeps, with accumulate) the result pair.
  sum_squares_final<<<1, kThreads, 0, s>>>(part, flag, blocks, out, accumulate);
  ZS_CUDA_CHECK_LAUNCH("cuda::sum_squares_nonfinite (pass 2)");
}

void convert(const void* src, DType src_dtype, void* dst, DType dst_dtype, int64_t n,
             StreamHandle stream) {
  if (n < 0 || (n > 0 && (!src || !dst)))
    ZS_THROW(invalid_argument, "cuda::convert: bad arguments (n = " << n << ")");
  if (n == 0) return;
  auto s = static_cast<cudaStream_t>(stream);
  // Same dtype is a byte copy, which also keeps NaN payloads (as the CPU kernel does).
  if (src_dtype == dst_dtype) {
    ZS_CUDA_CHECK(
        cudaMemcpyAsync(dst, src, size_t(n) * elem_bytes(src_dtype), cudaMemcpyDeviceToDevice, s));
    return;
  }
  const unsigned grid = grid_for(vectors(n), kMaxGrid);
  const bool aligned = aligned16(src) && aligned16(dst);
  with_dtype(src_dtype, [&](auto S) {
    with_dtype(dst_dtype, [&](auto D) {
      constexpr DType kS = decltype(S)::value, kD = decltype(D)::value;
      // Same-dtype pairs never get here; not instantiating them keeps the build small.
      if constexpr (kS != kD) {
        if (aligned) {
          convert_kernel<kS, kD, true><<<grid, kThreads, 0, s>>>(src, dst, n);
        } else {
          convert_kernel<kS, kD, false><<<grid, kThreads, 0, s>>>(src, dst, n);
        }
      }
    });
  });
  ZS_CUDA_CHECK_LAUNCH("cuda::convert (" << dtype_name(src_dtype) << " to " << dtype_name(dst_dtype)
                                         << ")");
}

void accumulate(float* acc, const void* g, DType g_dtype, int64_t n, StreamHandle stream) {
  if (n < 0 || (n > 0 && (!acc || !g)))
    ZS_THROW(invalid_argument, "cuda::accumulate: bad arguments (n = " << n << ")");
  if (n == 0) return;
  auto s = static_cast<cudaStream_t>(stream);
  const unsigned grid = grid_for(vectors(n), kMaxGrid);
  const bool aligned = aligned16(acc) && aligned16(g);
  with_dtype(g_dtype, [&](auto G) {
    if (aligned) {
      accumulate_kernel<decltype(G)::value, true><<<grid, kThreads, 0, s>>>(acc, g, n);
    } else {
      accumulate_kernel<decltype(G)::value, false><<<grid, kThreads, 0, s>>>(acc, g, n);
    }
  });
  ZS_CUDA_CHECK_LAUNCH("cuda::accumulate (grad " << dtype_name(g_dtype) << ")");
}

}  // namespace zeroshard::cuda
