// The demo model's layers on the GPU (ops_cuda.hpp): cuBLAS for the matrix products, simple
// kernels for the rest. Kernels favour obviously-correct over fast: one block per row for row
// reductions (a shared-memory tree, every thread reaching every barrier), one thread per output
// element elsewhere, no atomics, so every result is computed in one fixed order.
//
// Built with --fmad=false (apps/CMakeLists.txt): the element-wise arithmetic then rounds each
// operation like the host code does (no contraction into fused multiply-adds).

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <string>

#include "apps/model/ops_cuda.hpp"
#include "zeroshard/error.hpp"

namespace zsdemo::gpu {
namespace {

[[noreturn]] void fail(zeroshard::ErrorCode code, const std::string& msg) {
  throw zeroshard::Error(code, msg);
}

void check_cuda(cudaError_t e, const char* expr, const char* file, int line) {
  if (e != cudaSuccess)
    fail(zeroshard::ErrorCode::cuda_error, std::string(expr) + " failed at " + file + ":" +
                                               std::to_string(line) + ": " + cudaGetErrorName(e) +
                                               ": " + cudaGetErrorString(e));
}

void check_cublas(cublasStatus_t s, const char* expr, const char* file, int line) {
  if (s != CUBLAS_STATUS_SUCCESS)
    fail(zeroshard::ErrorCode::cuda_error,
         std::string(expr) + " failed at " + file + ":" + std::to_string(line) + ": " +
             cublasGetStatusName(s) + ": " + cublasGetStatusString(s));
}

}  // namespace
}  // namespace zsdemo::gpu

#define ZSDEMO_CUDA(expr) ::zsdemo::gpu::check_cuda((expr), #expr, __FILE__, __LINE__)
#define ZSDEMO_CUBLAS(expr) ::zsdemo::gpu::check_cublas((expr), #expr, __FILE__, __LINE__)
// A launch error (bad configuration, no kernel image for this GPU) shows up here; errors of the
// kernel's execution surface at the next synchronisation of the stream.
#define ZSDEMO_LAUNCHED(name) \
  ::zsdemo::gpu::check_cuda(cudaGetLastError(), "launch of " name, __FILE__, __LINE__)

namespace zsdemo::gpu {

struct Context::Impl {
  cudaStream_t stream = nullptr;
  cublasHandle_t blas = nullptr;
  int device = 0;
  void* scratch = nullptr;  // the loss reduction's per-row partials and result
  size_t scratch_bytes = 0;

  // Device scratch of at least `bytes`, valid in stream order until the next call. Grows only
  // (the model asks for the same size every step, so it is allocated once).
  void* get_scratch(size_t bytes) {
    if (bytes > scratch_bytes) {
      // Earlier work on the stream may still read the old buffer.
      ZSDEMO_CUDA(cudaStreamSynchronize(stream));
      if (scratch) ZSDEMO_CUDA(cudaFree(scratch));
      scratch = nullptr;
      scratch_bytes = 0;
      const size_t want = std::max(bytes, size_t{4096});
      ZSDEMO_CUDA(cudaMalloc(&scratch, want));
      scratch_bytes = want;
    }
    return scratch;
  }

  ~Impl() {
    // Destructors never throw: errors here (typically cudaErrorCudartUnloading at exit) are
    // ignored, the memory goes with the context anyway.
    if (stream || scratch) (void)cudaStreamSynchronize(stream);
    if (scratch) (void)cudaFree(scratch);
    if (blas) (void)cublasDestroy(blas);
  }
};

void set_device(int device) {
  ZSDEMO_CUDA(cudaSetDevice(device));
}

Context::Context(void* stream) : impl_(std::make_unique<Impl>()) {
  Impl& m = *impl_;
  m.stream = static_cast<cudaStream_t>(stream);
  ZSDEMO_CUDA(cudaGetDevice(&m.device));
  // On failure below, ~Impl (run by impl_'s destructor) destroys what was created.
  ZSDEMO_CUBLAS(cublasCreate(&m.blas));
  ZSDEMO_CUBLAS(cublasSetStream(m.blas, m.stream));
  // Plain f32 products (no TF32, no BF16x9 emulation), so the GPU model agrees with the CPU
  // one to f32 rounding; alpha and beta are host scalars.
  ZSDEMO_CUBLAS(cublasSetMathMode(m.blas, CUBLAS_DEFAULT_MATH));
  ZSDEMO_CUBLAS(cublasSetPointerMode(m.blas, CUBLAS_POINTER_MODE_HOST));
}

Context::~Context() = default;
Context::Context(Context&&) noexcept = default;
Context& Context::operator=(Context&&) noexcept = default;

void* Context::stream() const {
  return static_cast<void*>(impl_->stream);
}

void Context::set_stream(void* stream) {
  ZSDEMO_CUDA(cudaStreamSynchronize(impl_->stream));
  ZSDEMO_CUBLAS(cublasSetStream(impl_->blas, static_cast<cudaStream_t>(stream)));
  impl_->stream = static_cast<cudaStream_t>(stream);
}

void Context::synchronize() const {
  ZSDEMO_CUDA(cudaStreamSynchronize(impl_->stream));
}

int Context::device() const {
  return impl_->device;
}

void copy_to_device(Context& ctx, void* dst, const void* src, size_t bytes) {
  if (bytes)
    ZSDEMO_CUDA(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, ctx.impl().stream));
}

void copy_to_host(Context& ctx, void* dst, const void* src, size_t bytes) {
  if (bytes)
    ZSDEMO_CUDA(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, ctx.impl().stream));
  ZSDEMO_CUDA(cudaStreamSynchronize(ctx.impl().stream));
}

void fill_zero(Context& ctx, void* dst, size_t bytes) {
  if (bytes) ZSDEMO_CUDA(cudaMemsetAsync(dst, 0, bytes, ctx.impl().stream));
}

namespace {

// Threads per block of the row kernels; a power of two (the tree reductions halve it).
constexpr int kRowThreads = 128;
// Threads per block of the element-wise kernels, and the most blocks one launch uses (a grid-
// stride loop covers the rest).
constexpr int kEltThreads = 256;
constexpr int64_t kMaxEltBlocks = 65536;

constexpr float kGeluK = 0.7978845608028654f;  // sqrt(2 / pi), as ops.cpp
constexpr float kGeluC = 0.044715f;
constexpr float kLnEps = 1e-5f;

int elt_blocks(int64_t n) {
  return int(std::min<int64_t>(kMaxEltBlocks, (n + kEltThreads - 1) / kEltThreads));
}

// Grid dimension for one block per row: CUDA's grid.x limit is 2^31 − 1.
unsigned row_blocks(int64_t rows) {
  if (rows > INT_MAX)
    fail(zeroshard::ErrorCode::invalid_argument,
         "demo GPU ops: " + std::to_string(rows) + " rows exceed one grid");
  return unsigned(rows);
}

int to_int(int64_t v, const char* what) {
  if (v < 0 || v > INT_MAX)
    fail(zeroshard::ErrorCode::invalid_argument, std::string("demo GPU ops: ") + what + " = " +
                                                     std::to_string(v) +
                                                     " does not fit cuBLAS's int");
  return int(v);
}

// Sum over the block of one value per thread, returned to every thread. Fixed tree order, so
// the result does not depend on timing. Every thread of the block must call it (it has
// barriers); `sh` holds kRowThreads values and is free again on return.
template <class T>
__device__ T block_sum(T v, T* sh) {
  const int tid = int(threadIdx.x);
  sh[tid] = v;
  __syncthreads();
  for (int s = kRowThreads / 2; s > 0; s >>= 1) {
    if (tid < s) sh[tid] += sh[tid + s];
    __syncthreads();
  }
  const T r = sh[0];
  __syncthreads();  // everyone has read sh[0] before the next use overwrites it
  return r;
}

// As block_sum, for the maximum (NaN-unaware, like the CPU code's std::max).
__device__ float block_max(float v, float* sh) {
  const int tid = int(threadIdx.x);
  sh[tid] = v;
  __syncthreads();
  for (int s = kRowThreads / 2; s > 0; s >>= 1) {
    if (tid < s) sh[tid] = fmaxf(sh[tid], sh[tid + s]);
    __syncthreads();
  }
  const float r = sh[0];
  __syncthreads();
  return r;
}

// ---- GEMM ----------------------------------------------------------------------------------

// Row-major C[m, n] = alpha · op(A) · op(B) + beta · C with leading dimensions, as ops.cpp's
// gemm. cuBLAS is column-major; a row-major matrix read as column-major (same leading
// dimension) is its transpose, and Cᵀ = op(B)ᵀ · op(A)ᵀ. So: swap the operands and m ↔ n, keep
// each operand's transpose flag. With beta = 0, C is not read (may hold anything).
void gemm(Context& ctx, bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha,
          const float* a, int64_t lda, const float* b, int64_t ldb, float beta, float* c,
          int64_t ldc) {
  ZSDEMO_CUBLAS(cublasSgemm(ctx.impl().blas, tb ? CUBLAS_OP_T : CUBLAS_OP_N,
                            ta ? CUBLAS_OP_T : CUBLAS_OP_N, to_int(n, "n"), to_int(m, "m"),
                            to_int(k, "k"), &alpha, b, to_int(ldb, "ldb"), a, to_int(lda, "lda"),
                            &beta, c, to_int(ldc, "ldc")));
}

// `count` independent gemm()s; matrix i of each operand starts `stride` floats after matrix
// i − 1. The outputs must not overlap (they may interleave, as heads do inside one row).
void gemm_batched(Context& ctx, bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha,
                  const float* a, int64_t lda, int64_t stride_a, const float* b, int64_t ldb,
                  int64_t stride_b, float beta, float* c, int64_t ldc, int64_t stride_c,
                  int64_t count) {
  ZSDEMO_CUBLAS(cublasSgemmStridedBatched(
      ctx.impl().blas, tb ? CUBLAS_OP_T : CUBLAS_OP_N, ta ? CUBLAS_OP_T : CUBLAS_OP_N,
      to_int(n, "n"), to_int(m, "m"), to_int(k, "k"), &alpha, b, to_int(ldb, "ldb"),
      static_cast<long long>(stride_b), a, to_int(lda, "lda"), static_cast<long long>(stride_a),
      &beta, c, to_int(ldc, "ldc"), static_cast<long long>(stride_c), to_int(count, "count")));
}

// ---- kernels -------------------------------------------------------------------------------

// y[r, j] = b[j]: the bias, before the GEMM adds x·w on top (beta = 1), as on the CPU.
__global__ void broadcast_rows_kernel(const float* b, float* y, int64_t total, int64_t out) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
       i += int64_t(gridDim.x) * blockDim.x)
    y[i] = b[i % out];
}

// Column sums over rows, shared by the bias and layer-norm gradients: a block covers 32 columns
// with 8 lanes of rows each (lane ty sums rows ty, ty + 8, …), then lane 0 adds the 8 partial
// sums in order. Coalesced reads (a warp reads 32 consecutive columns of one row).
constexpr int kColTile = 32;
constexpr int kColLanes = 8;

// db[j] += Σ_r dy[r, j].
__global__ void column_sum_add_kernel(const float* dy, float* db, int64_t n, int64_t out) {
  __shared__ float part[kColLanes][kColTile + 1];
  const int tx = int(threadIdx.x), ty = int(threadIdx.y);
  const int64_t j = int64_t(blockIdx.x) * kColTile + tx;
  float s = 0.0f;
  if (j < out)
    for (int64_t r = ty; r < n; r += kColLanes) s += dy[r * out + j];
  part[ty][tx] = s;
  __syncthreads();
  if (ty == 0 && j < out) {
    float t = 0.0f;
    for (int i = 0; i < kColLanes; ++i) t += part[i][tx];
    db[j] += t;
  }
}

// dg[j] += Σ_r x̂[r, j] · dy[r, j] and db[j] += Σ_r dy[r, j], x̂ = (x − mean) · rstd.
__global__ void layernorm_param_grad_kernel(const float* x, const float* mean, const float* rstd,
                                            const float* dy, float* dg, float* db, int64_t n,
                                            int64_t c) {
  __shared__ float pg[kColLanes][kColTile + 1];
  __shared__ float pb[kColLanes][kColTile + 1];
  const int tx = int(threadIdx.x), ty = int(threadIdx.y);
  const int64_t j = int64_t(blockIdx.x) * kColTile + tx;
  float sg = 0.0f, sb = 0.0f;
  if (j < c)
    for (int64_t r = ty; r < n; r += kColLanes) {
      const float xh = (x[r * c + j] - mean[r]) * rstd[r], d = dy[r * c + j];
      sg += xh * d;
      sb += d;
    }
  pg[ty][tx] = sg;
  pb[ty][tx] = sb;
  __syncthreads();
  if (ty == 0 && j < c) {
    float tg = 0.0f, tb = 0.0f;
    for (int i = 0; i < kColLanes; ++i) tg += pg[i][tx], tb += pb[i][tx];
    dg[j] += tg;
    db[j] += tb;
  }
}

// One block per row; mean and centred variance in double, as the CPU code.
__global__ void layernorm_forward_kernel(const float* x, const float* g, const float* b, float* y,
                                         float* mean, float* rstd, int64_t c) {
  __shared__ double sh[kRowThreads];
  const int64_t r = blockIdx.x;
  const float* xr = x + r * c;
  float* yr = y + r * c;
  double s = 0;
  for (int64_t j = threadIdx.x; j < c; j += kRowThreads) s += xr[j];
  const float m = float(block_sum(s, sh) / double(c));
  double v = 0;
  for (int64_t j = threadIdx.x; j < c; j += kRowThreads) {
    const double d = double(xr[j] - m);
    v += d * d;
  }
  const float rs = 1.0f / sqrtf(float(block_sum(v, sh) / double(c)) + kLnEps);
  for (int64_t j = threadIdx.x; j < c; j += kRowThreads) yr[j] = (xr[j] - m) * rs * g[j] + b[j];
  if (threadIdx.x == 0) {
    mean[r] = m;
    rstd[r] = rs;
  }
}

// dx += rstd · (dn − mean(dn) − x̂ · mean(dn · x̂)), dn = dy · g; one block per row.
__global__ void layernorm_backward_dx_kernel(const float* x, const float* g, const float* mean,
                                             const float* rstd, const float* dy, float* dx,
                                             int64_t c) {
  __shared__ double sh[kRowThreads];
  const int64_t r = blockIdx.x;
  const float* xr = x + r * c;
  const float* dyr = dy + r * c;
  float* dxr = dx + r * c;
  const float m = mean[r], rs = rstd[r];
  double sdn = 0, sdnxh = 0;
  for (int64_t j = threadIdx.x; j < c; j += kRowThreads) {
    const float xh = (xr[j] - m) * rs, dn = dyr[j] * g[j];
    sdn += dn;
    sdnxh += double(dn) * double(xh);
  }
  const float mean_dn = float(block_sum(sdn, sh) / double(c));
  const float mean_dn_xh = float(block_sum(sdnxh, sh) / double(c));
  for (int64_t j = threadIdx.x; j < c; j += kRowThreads) {
    const float xh = (xr[j] - m) * rs;
    dxr[j] += rs * (dyr[j] * g[j] - mean_dn - xh * mean_dn_xh);
  }
}

__global__ void gelu_forward_kernel(const float* x, float* y, int64_t n) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    const float v = x[i];
    y[i] = 0.5f * v * (1.0f + tanhf(kGeluK * (v + kGeluC * v * v * v)));
  }
}

__global__ void gelu_backward_kernel(const float* x, const float* dy, float* dx, int64_t n) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    const float v = x[i];
    const float t = tanhf(kGeluK * (v + kGeluC * v * v * v));
    const float d =
        0.5f * (1.0f + t) + 0.5f * v * (1.0f - t * t) * kGeluK * (1.0f + 3.0f * kGeluC * v * v);
    dx[i] = d * dy[i];
  }
}

// Causal softmax of the scores in place: one block per row of every [T, T] block (row index i =
// blockIdx.x mod T); entries j > i become 0. Each thread rewrites only the entries it read.
__global__ void causal_softmax_kernel(float* p, int64_t t) {
  __shared__ float shm[kRowThreads];
  __shared__ double shs[kRowThreads];
  const int64_t row = blockIdx.x, i = row % t;
  float* pr = p + row * t;
  float mx = -INFINITY;
  for (int64_t j = threadIdx.x; j <= i; j += kRowThreads) mx = fmaxf(mx, pr[j]);
  mx = block_max(mx, shm);
  double sum = 0;
  for (int64_t j = threadIdx.x; j <= i; j += kRowThreads) {
    const float e = expf(pr[j] - mx);
    pr[j] = e;
    sum += e;
  }
  const float inv = 1.0f / float(block_sum(sum, shs));
  for (int64_t j = threadIdx.x; j <= i; j += kRowThreads) pr[j] *= inv;
  for (int64_t j = i + 1 + threadIdx.x; j < t; j += kRowThreads) pr[j] = 0.0f;
}

// Softmax backward in place on dP: dS = P ⊙ (dP − Σ_j dP·P) for j ≤ i, 0 above the diagonal.
__global__ void causal_softmax_backward_kernel(const float* p, float* d, int64_t t) {
  __shared__ double sh[kRowThreads];
  const int64_t row = blockIdx.x, i = row % t;
  const float* pr = p + row * t;
  float* dr = d + row * t;
  double dot = 0;
  for (int64_t j = threadIdx.x; j <= i; j += kRowThreads) dot += double(pr[j]) * double(dr[j]);
  const float fdot = float(block_sum(dot, sh));
  for (int64_t j = threadIdx.x; j <= i; j += kRowThreads) dr[j] = pr[j] * (dr[j] - fdot);
  for (int64_t j = i + 1 + threadIdx.x; j < t; j += kRowThreads) dr[j] = 0.0f;
}

// Softmax of each logits row in place and the row's −log p[target] (from log-sum-exp, finite
// where the probability underflows), as the CPU code: float max, double sum of the float exps.
__global__ void softmax_xent_rows_kernel(float* logits, const int32_t* targets, double* row_loss,
                                         int64_t v) {
  __shared__ float shm[kRowThreads];
  __shared__ double shs[kRowThreads];
  const int64_t r = blockIdx.x;
  float* row = logits + r * v;
  // Read before any thread passes the barrier in block_max: the row is overwritten after it.
  const float target_logit = threadIdx.x == 0 ? row[targets[r]] : 0.0f;
  float mx = -INFINITY;
  for (int64_t j = threadIdx.x; j < v; j += kRowThreads) mx = fmaxf(mx, row[j]);
  mx = block_max(mx, shm);
  double sum = 0;
  for (int64_t j = threadIdx.x; j < v; j += kRowThreads) {
    const float e = expf(row[j] - mx);
    row[j] = e;
    sum += e;
  }
  const double total = block_sum(sum, shs);
  const float inv = float(1.0 / total);
  for (int64_t j = threadIdx.x; j < v; j += kRowThreads) row[j] *= inv;
  if (threadIdx.x == 0) row_loss[r] = log(total) + double(mx) - double(target_logit);
}

// *mean = Σ row_loss / n in one block: a fixed order, so the same bits on every run.
__global__ void mean_kernel(const double* row_loss, int64_t n, double* mean) {
  __shared__ double sh[kRowThreads];
  double s = 0;
  for (int64_t i = threadIdx.x; i < n; i += kRowThreads) s += row_loss[i];
  const double total = block_sum(s, sh);
  if (threadIdx.x == 0) *mean = total / double(n);
}

// dlogits = (p − onehot) · f: p·f, minus f at the target (the CPU's two steps, same rounding).
__global__ void softmax_xent_backward_kernel(float* p, const int32_t* targets, int64_t total,
                                             int64_t v, float f) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
       i += int64_t(gridDim.x) * blockDim.x) {
    float g = p[i] * f;
    if (i % v == targets[i / v]) g -= f;
    p[i] = g;
  }
}

__global__ void add_inplace_kernel(float* y, const float* x, int64_t n) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x)
    y[i] += x[i];
}

__global__ void embedding_forward_kernel(const int32_t* tokens, const float* wte, const float* wpe,
                                         float* x, int64_t total, int64_t t, int64_t c) {
  for (int64_t e = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; e < total;
       e += int64_t(gridDim.x) * blockDim.x) {
    const int64_t i = e / c, j = e % c;
    x[e] = wte[int64_t(tokens[i]) * c + j] + wpe[(i % t) * c + j];
  }
}

// Token v's gradient row: blockIdx.x = v, channels blockIdx.y · blockDim.x + threadIdx.x.
__global__ void embedding_backward_wte_kernel(const int32_t* offsets, const int32_t* rows,
                                              const float* dx, float* dwte, int64_t c) {
  const int64_t v = blockIdx.x;
  const int64_t j = int64_t(blockIdx.y) * blockDim.x + threadIdx.x;
  if (j >= c) return;
  const int32_t begin = offsets[v], end = offsets[v + 1];
  if (begin == end) return;
  float acc = dwte[v * c + j];
  for (int32_t k = begin; k < end; ++k) acc += dx[int64_t(rows[k]) * c + j];
  dwte[v * c + j] = acc;
}

// Position p's gradient: one thread per (p, channel); rows p, p + t, … in ascending order.
__global__ void embedding_backward_wpe_kernel(const float* dx, float* dwpe, int64_t n, int64_t t,
                                              int64_t c) {
  for (int64_t e = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; e < t * c;
       e += int64_t(gridDim.x) * blockDim.x) {
    float acc = dwpe[e];
    for (int64_t i = e / c; i < n; i += t) acc += dx[i * c + e % c];
    dwpe[e] = acc;
  }
}

}  // namespace

void linear_forward(Context& ctx, const float* x, const float* w, const float* b, float* y,
                    int64_t n, int64_t in, int64_t out) {
  cudaStream_t st = ctx.impl().stream;
  if (n == 0 || out == 0) return;
  if (b) {
    broadcast_rows_kernel<<<elt_blocks(n * out), kEltThreads, 0, st>>>(b, y, n * out, out);
    ZSDEMO_LAUNCHED("broadcast_rows_kernel");
  }
  gemm(ctx, false, false, n, out, in, 1.0f, x, in, w, out, b ? 1.0f : 0.0f, y, out);
}

void linear_backward(Context& ctx, const float* x, const float* w, const float* dy, float* dx,
                     float* dw, float* db, int64_t n, int64_t in, int64_t out) {
  if (n == 0 || in == 0 || out == 0) return;
  if (dx) gemm(ctx, false, true, n, in, out, 1.0f, dy, out, w, out, 0.0f, dx, in);
  gemm(ctx, true, false, in, out, n, 1.0f, x, in, dy, out, 1.0f, dw, out);
  if (db) {
    const dim3 block(kColTile, kColLanes);
    const unsigned blocks = row_blocks((out + kColTile - 1) / kColTile);
    column_sum_add_kernel<<<blocks, block, 0, ctx.impl().stream>>>(dy, db, n, out);
    ZSDEMO_LAUNCHED("column_sum_add_kernel");
  }
}

void layernorm_forward(Context& ctx, const float* x, const float* g, const float* b, float* y,
                       float* mean, float* rstd, int64_t n, int64_t c) {
  if (n == 0) return;
  layernorm_forward_kernel<<<row_blocks(n), kRowThreads, 0, ctx.impl().stream>>>(x, g, b, y, mean,
                                                                                 rstd, c);
  ZSDEMO_LAUNCHED("layernorm_forward_kernel");
}

void layernorm_backward(Context& ctx, const float* x, const float* g, const float* mean,
                        const float* rstd, const float* dy, float* dx, float* dg, float* db,
                        int64_t n, int64_t c) {
  if (n == 0) return;
  cudaStream_t st = ctx.impl().stream;
  layernorm_backward_dx_kernel<<<row_blocks(n), kRowThreads, 0, st>>>(x, g, mean, rstd, dy, dx, c);
  ZSDEMO_LAUNCHED("layernorm_backward_dx_kernel");
  const dim3 block(kColTile, kColLanes);
  layernorm_param_grad_kernel<<<row_blocks((c + kColTile - 1) / kColTile), block, 0, st>>>(
      x, mean, rstd, dy, dg, db, n, c);
  ZSDEMO_LAUNCHED("layernorm_param_grad_kernel");
}

void gelu_forward(Context& ctx, const float* x, float* y, int64_t n) {
  if (n == 0) return;
  gelu_forward_kernel<<<elt_blocks(n), kEltThreads, 0, ctx.impl().stream>>>(x, y, n);
  ZSDEMO_LAUNCHED("gelu_forward_kernel");
}

void gelu_backward(Context& ctx, const float* x, const float* dy, float* dx, int64_t n) {
  if (n == 0) return;
  gelu_backward_kernel<<<elt_blocks(n), kEltThreads, 0, ctx.impl().stream>>>(x, dy, dx, n);
  ZSDEMO_LAUNCHED("gelu_backward_kernel");
}

void attention_forward(Context& ctx, const float* qkv, float* y, float* probs, int64_t batch,
                       int64_t t, int64_t c, int64_t heads) {
  const int64_t hd = c / heads, ld = 3 * c, tt = t * t;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  if (batch * t * c == 0) return;
  // Per sequence, every head at once: head h's q, k, v are the columns [h·hd, (h+1)·hd) of
  // their third of qkv, so consecutive heads are hd floats apart; its scores are the h-th T×T
  // block of probs.
  for (int64_t b = 0; b < batch; ++b) {
    const float* q = qkv + b * t * ld;
    float* p = probs + b * heads * tt;
    gemm_batched(ctx, false, true, t, t, hd, scale, q, ld, hd, q + c, ld, hd, 0.0f, p, t, tt,
                 heads);
  }
  causal_softmax_kernel<<<row_blocks(batch * heads * t), kRowThreads, 0, ctx.impl().stream>>>(probs,
                                                                                              t);
  ZSDEMO_LAUNCHED("causal_softmax_kernel");
  for (int64_t b = 0; b < batch; ++b) {
    const float* v = qkv + b * t * ld + 2 * c;
    gemm_batched(ctx, false, false, t, hd, t, 1.0f, probs + b * heads * tt, t, tt, v, ld, hd, 0.0f,
                 y + b * t * c, c, hd, heads);
  }
}

void attention_backward(Context& ctx, const float* qkv, const float* probs, const float* dy,
                        float* dqkv, float* scratch, int64_t batch, int64_t t, int64_t c,
                        int64_t heads) {
  const int64_t hd = c / heads, ld = 3 * c, tt = t * t;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  if (batch * t * c == 0) return;
  // dP = dY·Vᵀ (into scratch) and dV = Pᵀ·dY.
  for (int64_t b = 0; b < batch; ++b) {
    const float* v = qkv + b * t * ld + 2 * c;
    const float* dyb = dy + b * t * c;
    const float* p = probs + b * heads * tt;
    float* ds = scratch + b * heads * tt;
    gemm_batched(ctx, false, true, t, t, hd, 1.0f, dyb, c, hd, v, ld, hd, 0.0f, ds, t, tt, heads);
    gemm_batched(ctx, true, false, t, hd, t, 1.0f, p, t, tt, dyb, c, hd, 0.0f,
                 dqkv + b * t * ld + 2 * c, ld, hd, heads);
  }
  causal_softmax_backward_kernel<<<row_blocks(batch * heads * t), kRowThreads, 0,
                                   ctx.impl().stream>>>(probs, scratch, t);
  ZSDEMO_LAUNCHED("causal_softmax_backward_kernel");
  // S = scale · Q·Kᵀ, so dQ = scale · dS·K and dK = scale · dSᵀ·Q.
  for (int64_t b = 0; b < batch; ++b) {
    const float* q = qkv + b * t * ld;
    const float* ds = scratch + b * heads * tt;
    float* dq = dqkv + b * t * ld;
    gemm_batched(ctx, false, false, t, hd, t, scale, ds, t, tt, q + c, ld, hd, 0.0f, dq, ld, hd,
                 heads);
    gemm_batched(ctx, true, false, t, hd, t, scale, ds, t, tt, q, ld, hd, 0.0f, dq + c, ld, hd,
                 heads);
  }
}

void softmax_cross_entropy_async(Context& ctx, float* logits, const int32_t* targets, int64_t n,
                                 int64_t v, double* mean_loss) {
  if (n == 0) fail(zeroshard::ErrorCode::invalid_argument, "softmax_cross_entropy: no rows");
  auto* row_loss = static_cast<double*>(ctx.impl().get_scratch(size_t(n) * sizeof(double)));
  cudaStream_t st = ctx.impl().stream;
  softmax_xent_rows_kernel<<<row_blocks(n), kRowThreads, 0, st>>>(logits, targets, row_loss, v);
  ZSDEMO_LAUNCHED("softmax_xent_rows_kernel");
  mean_kernel<<<1, kRowThreads, 0, st>>>(row_loss, n, mean_loss);
  ZSDEMO_LAUNCHED("mean_kernel");
}

double softmax_cross_entropy(Context& ctx, float* logits, const int32_t* targets, int64_t n,
                             int64_t v) {
  // The loss goes in the scratch after the n per-row partials.
  auto* row_loss = static_cast<double*>(ctx.impl().get_scratch(size_t(n + 1) * sizeof(double)));
  softmax_cross_entropy_async(ctx, logits, targets, n, v, row_loss + n);
  double loss = 0;
  copy_to_host(ctx, &loss, row_loss + n, sizeof loss);
  return loss;
}

void softmax_cross_entropy_backward(Context& ctx, float* probs_to_dlogits, const int32_t* targets,
                                    int64_t n, int64_t v, float scale) {
  if (n == 0) return;
  const float f = scale / static_cast<float>(n);
  softmax_xent_backward_kernel<<<elt_blocks(n * v), kEltThreads, 0, ctx.impl().stream>>>(
      probs_to_dlogits, targets, n * v, v, f);
  ZSDEMO_LAUNCHED("softmax_xent_backward_kernel");
}

void add_inplace(Context& ctx, float* y, const float* x, int64_t n) {
  if (n == 0) return;
  add_inplace_kernel<<<elt_blocks(n), kEltThreads, 0, ctx.impl().stream>>>(y, x, n);
  ZSDEMO_LAUNCHED("add_inplace_kernel");
}

void embedding_forward(Context& ctx, const int32_t* tokens, const float* wte, const float* wpe,
                       float* x, int64_t n, int64_t t, int64_t c) {
  if (n == 0) return;
  embedding_forward_kernel<<<elt_blocks(n * c), kEltThreads, 0, ctx.impl().stream>>>(
      tokens, wte, wpe, x, n * c, t, c);
  ZSDEMO_LAUNCHED("embedding_forward_kernel");
}

void embedding_backward(Context& ctx, const int32_t* token_offsets, const int32_t* token_rows,
                        const float* dx, float* dwte, float* dwpe, int64_t n, int64_t t, int64_t c,
                        int64_t vocab) {
  if (n == 0) return;
  if (n > INT_MAX)
    fail(zeroshard::ErrorCode::invalid_argument, "embedding_backward: rows exceed int32");
  cudaStream_t st = ctx.impl().stream;
  const int64_t chunks = (c + kEltThreads - 1) / kEltThreads;
  if (chunks > 65535)
    fail(zeroshard::ErrorCode::invalid_argument, "embedding_backward: too many channels");
  const dim3 grid(row_blocks(vocab), unsigned(chunks));
  embedding_backward_wte_kernel<<<grid, kEltThreads, 0, st>>>(token_offsets, token_rows, dx, dwte,
                                                              c);
  ZSDEMO_LAUNCHED("embedding_backward_wte_kernel");
  embedding_backward_wpe_kernel<<<elt_blocks(t * c), kEltThreads, 0, st>>>(dx, dwpe, n, t, c);
  ZSDEMO_LAUNCHED("embedding_backward_wpe_kernel");
}

}  // namespace zsdemo::gpu
