// Muon on the GPU (cuda_kernels.hpp): the momentum average a matrix's direction is made from,
// bitwise cpu::muon_average (the same operations per element, each an __f*_rn intrinsic), and
// the Newton-Schulz iteration of cpu::newton_schulz, step for step, with the products by
// cuBLAS's SGEMM in f32 (no TF32): the same sums in another order, so not bitwise the CPU's.

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <utility>

#include "base/check.hpp"
#include "base/cuda_check.hpp"
#include "kernels/cpu/newton_schulz.hpp"
#include "kernels/cpu/quant_code.hpp"
#include "kernels/cuda/cuda_kernels.hpp"
#include "kernels/cuda/device_io.cuh"
#include "kernels/cuda/launch_math.hpp"
#include "kernels/cuda/update_one.cuh"

namespace zeroshard::cuda {
namespace {

using launch::kThreads;

// One element per thread, in grid-stride loops over the element-wise grid (launch_math.hpp).
unsigned grid(int64_t n) {
  return launch::grid_for(n, launch::kMaxGrid);
}

// The momentum of element e, widened: f32 or bf16 as stored, or its code's point × absmax
// (8-bit, cpu::Q8Code).
template <DType G, StateFormat F>
__global__ void __launch_bounds__(kThreads)
    average_kernel(const void* grad, const void* s0, const float* absmax, int64_t block, int64_t lo,
                   int64_t n, float gs, float mu, float omm, bool nesterov, float* d) {
  for (int64_t i = launch::first_vector(blockIdx.x, threadIdx.x); i < n;
       i += launch::grid_stride(gridDim.x)) {
    const int64_t e = lo + i;
    float m;
    if constexpr (F == StateFormat::q8)
      m = __fmul_rn(
          __uint_as_float(cpu::Q8Code<true>::point_bits(static_cast<const uint8_t*>(s0)[e])),
          absmax[e / block]);
    else if constexpr (F == StateFormat::bf16)
      m = dev::load1<DType::bf16>(s0, e);
    else
      m = dev::load1<DType::f32>(s0, e);
    const float g = __fmul_rn(dev::load1<G>(grad, e), gs);
    const float buf = __fadd_rn(__fmul_rn(mu, m), __fmul_rn(omm, g));
    d[i] = nesterov ? __fadd_rn(__fmul_rn(omm, g), __fmul_rn(mu, buf)) : buf;
  }
}

__device__ __forceinline__ float round_bf16(float x) {
  return dev::bf16_bits_to_float(dev::float_to_bf16_bits(x));
}

__global__ void __launch_bounds__(kThreads) round_kernel(float* x, int64_t n) {
  for (int64_t i = launch::first_vector(blockIdx.x, threadIdx.x); i < n;
       i += launch::grid_stride(gridDim.x))
    x[i] = round_bf16(x[i]);
}

// out (cols × rows) = inᵀ × scale, with in rows × cols; both row-major.
__global__ void __launch_bounds__(kThreads)
    transpose_kernel(const float* in, int64_t rows, int64_t cols, float scale, float* out) {
  for (int64_t i = launch::first_vector(blockIdx.x, threadIdx.x); i < rows * cols;
       i += launch::grid_stride(gridDim.x)) {
    const int64_t r = i / cols, c = i % cols;
    out[c * rows + r] = __fmul_rn(in[i], scale);
  }
}

__global__ void __launch_bounds__(kThreads)
    scale_kernel(const float* in, int64_t n, float scale, float* out) {
  for (int64_t i = launch::first_vector(blockIdx.x, threadIdx.x); i < n;
       i += launch::grid_stride(gridDim.x))
    out[i] = __fmul_rn(in[i], scale);
}

// x / max(‖x‖_F, eps), ‖x‖_F² in sums[0] (double), then rounded where the CPU rounds.
__global__ void __launch_bounds__(kThreads)
    normalize_kernel(float* x, int64_t n, const double* sums, float eps, bool bf16) {
  float norm = float(sqrt(sums[0]));
  if (bf16) norm = round_bf16(norm);
  const float inv = norm < eps ? eps : norm;  // std::max(norm, eps): a NaN norm stays NaN
  for (int64_t i = launch::first_vector(blockIdx.x, threadIdx.x); i < n;
       i += launch::grid_stride(gridDim.x)) {
    const float y = __fdiv_rn(x[i], inv);
    x[i] = bf16 ? round_bf16(y) : y;
  }
}

void check_blas(cublasStatus_t st, const char* what) {
  if (st != CUBLAS_STATUS_SUCCESS)
    ZS_THROW(cuda_error,
             "cuda::newton_schulz: cuBLAS " << what << ": " << cublasGetStatusString(st));
}

// c = alpha·a·op(b) + beta·c, row-major as cpu::newton_schulz's gemm: a (m × k), op(b) (k × n),
// b n × k when `bt`. Column-major cuBLAS computes cᵀ = op(b)ᵀ·aᵀ on the same memory.
void gemm(cublasHandle_t h, int64_t m, int64_t n, int64_t k, float alpha, const float* a,
          const float* b, bool bt, float beta, float* c) {
  check_blas(cublasSgemm(h, bt ? CUBLAS_OP_T : CUBLAS_OP_N, CUBLAS_OP_N, int(n), int(m), int(k),
                         &alpha, b, bt ? int(k) : int(n), a, int(k), &beta, c, int(n)),
             "sgemm");
}

void round_all(float* x, int64_t n, bool bf16, cudaStream_t s) {
  if (!bf16) return;
  round_kernel<<<grid(n), kThreads, 0, s>>>(x, n);
  ZS_CUDA_CHECK_LAUNCH("cuda::newton_schulz (bf16 rounding)");
}

}  // namespace

void muon_average(const cpu::UpdateArgs& a, const cpu::UpdateHyper& h, int64_t lo, int64_t hi,
                  float* d, StreamHandle stream) {
  if (lo < 0 || hi > a.n || !a.grad || !a.state0 || !d)
    ZS_THROW(invalid_argument, "cuda::muon_average: elements [" << lo << ", " << hi << ") of "
                                                                << a.n << ", or a null array");
  if (lo >= hi) return;
  const StateFormat f = a.state_format;
  const auto s = static_cast<cudaStream_t>(stream);
  cpu::with_dtype(a.grad_dtype, [&](auto G) {
    constexpr DType kG = decltype(G)::value;
    auto launch = [&](auto kernel) {
      kernel<<<grid(hi - lo), kThreads, 0, s>>>(a.grad, a.state0, a.absmax0, a.block, lo, hi - lo,
                                                h.grad_scale, h.momentum, 1.0f - h.momentum,
                                                h.nesterov, d);
    };
    if (f == StateFormat::q8)
      launch(average_kernel<kG, StateFormat::q8>);
    else if (f == StateFormat::bf16)
      launch(average_kernel<kG, StateFormat::bf16>);
    else
      launch(average_kernel<kG, StateFormat::f32>);
  });
  ZS_CUDA_CHECK_LAUNCH("cuda::muon_average (grad " << dtype_name(a.grad_dtype) << ", moments "
                                                   << state_format_name(f) << ")");
}

void* create_blas() {
  cublasHandle_t h = nullptr;
  check_blas(cublasCreate(&h), "create");
  // Plain f32 products: TF32 would round the inputs to 10 bits of mantissa.
  check_blas(cublasSetMathMode(h, CUBLAS_PEDANTIC_MATH), "math mode");
  return h;
}

void destroy_blas(void* blas) noexcept {
  if (blas) (void)cublasDestroy(static_cast<cublasHandle_t>(blas));
}

void newton_schulz(float* x, int64_t rows, int64_t cols, const cpu::NsOptions& o, float* scratch,
                   double* sums, void* workspace, void* blas, StreamHandle stream) {
  if (rows < 1 || cols < 1 || o.steps < 0 || !x || !scratch || !sums || !workspace || !blas)
    ZS_THROW(invalid_argument, "cuda::newton_schulz: a " << rows << " x " << cols << " matrix, "
                                                         << o.steps
                                                         << " steps, or a null argument");
  if (rows > INT32_MAX || cols > INT32_MAX)
    ZS_THROW(invalid_argument, "cuda::newton_schulz: a " << rows << " x " << cols
                                                         << " matrix exceeds cuBLAS's int sizes");
  const auto s = static_cast<cudaStream_t>(stream);
  const auto h = static_cast<cublasHandle_t>(blas);
  check_blas(cublasSetStream(h, s), "set stream");
  const bool tall = rows > cols;
  const int64_t m = tall ? cols : rows, n = tall ? rows : cols;
  float* X = scratch;
  float* Y = X + m * n;
  float* A = Y + m * n;
  float* B = A + m * m;
  if (tall) {
    transpose_kernel<<<grid(m * n), kThreads, 0, s>>>(x, rows, cols, 1.0f, X);
    ZS_CUDA_CHECK_LAUNCH("cuda::newton_schulz (transpose)");
  } else {
    ZS_CUDA_CHECK(cudaMemcpyAsync(X, x, size_t(m * n) * 4, cudaMemcpyDeviceToDevice, s));
  }
  round_all(X, m * n, o.bf16, s);
  sum_squares_nonfinite(X, DType::f32, m * n, sums, false, workspace, s);
  normalize_kernel<<<grid(m * n), kThreads, 0, s>>>(X, m * n, sums, o.eps, o.bf16);
  ZS_CUDA_CHECK_LAUNCH("cuda::newton_schulz (normalize)");
  for (int step = 0; step < o.steps; ++step) {
    gemm(h, m, m, n, 1.0f, X, X, true, 0.0f, A);  // A = X·Xᵀ
    round_all(A, m * m, o.bf16, s);
    ZS_CUDA_CHECK(cudaMemcpyAsync(B, A, size_t(m * m) * 4, cudaMemcpyDeviceToDevice, s));
    gemm(h, m, m, m, cpu::kNsC, A, A, false, cpu::kNsB, B);  // B = b·A + c·A·A
    round_all(B, m * m, o.bf16, s);
    ZS_CUDA_CHECK(cudaMemcpyAsync(Y, X, size_t(m * n) * 4, cudaMemcpyDeviceToDevice, s));
    gemm(h, m, n, m, 1.0f, B, X, false, cpu::kNsA, Y);  // Y = a·X + B·X
    round_all(Y, m * n, o.bf16, s);
    std::swap(X, Y);
  }
  if (tall)
    transpose_kernel<<<grid(m * n), kThreads, 0, s>>>(X, m, n, o.scale, x);
  else
    scale_kernel<<<grid(m * n), kThreads, 0, s>>>(X, m * n, o.scale, x);
  ZS_CUDA_CHECK_LAUNCH("cuda::newton_schulz (scale)");
}

}  // namespace zeroshard::cuda
