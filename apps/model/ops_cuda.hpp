#pragma once
// The demo model's layers on a CUDA GPU: the functions of ops.hpp with the same names, shapes
// and semantics (row-major f32 matrices; backward ADDs into parameter gradients and overwrites
// input gradients unless it says otherwise; layernorm_backward accumulates dx), taking device
// pointers and a Context first. Plain C++: no CUDA header is needed to include this one (a
// stream is an opaque `void*` holding a cudaStream_t), so host-compiled code can call it. The
// definitions (ops_cuda.cu) are built only with ZEROSHARD_WITH_CUDA (ZSDEMO_HAVE_CUDA defined).
//
// Streams: every function only enqueues its work on the context's stream and returns, unless
// its comment says it synchronises. Pointers are device memory of the device that was current
// when the context was created; that device must be current on the calling thread. Errors throw
// zeroshard::Error(cuda_error) naming the call (kernel execution errors surface at the next
// synchronisation), zeroshard::Error(invalid_argument) for sizes cuBLAS cannot take (> 2^31 − 1).
//
// Numerics, against the CPU ops: matrix products are cuBLAS SGEMMs in CUBLAS_DEFAULT_MATH (true
// f32 arithmetic, never TF32), differing from OpenBLAS only in summation order; reductions over a
// row (layer norm, softmax, loss) accumulate in double like the CPU code or better; exp and tanh
// are CUDA's expf/tanhf (≤ 2 ulp) where the CPU uses libm expf and a polynomial tanh (≤ 2e-6
// relative, see ops.cpp). Every kernel here sums in a fixed order (no atomics), and cuBLAS is
// bitwise reproducible for one handle on one stream, so results are the same bits from run to
// run on one GPU model. tests/gpu/test_gpu_demo_ops.cpp states the bounds against the CPU.

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

namespace zsdemo::gpu {

// Device memory and the GPU count come from the library's public API (zeroshard::DeviceBuffer
// and cuda_device_count in zeroshard/device.hpp).

/// Makes `device` current on the calling thread (contexts and buffers are created there).
void set_device(int device);

/// What every GPU op needs: a cuBLAS handle bound to the caller's stream (f32 math mode), and a
/// small device scratch for the loss reduction. Created on the current device; move-only RAII.
class Context {
 public:
  /// `stream`: a cudaStream_t (nullptr = the legacy default stream) that the caller owns and
  /// keeps alive while the context uses it, e.g. the engine's compute stream.
  explicit Context(void* stream = nullptr);
  ~Context();
  Context(Context&&) noexcept;
  Context& operator=(Context&&) noexcept;
  Context(const Context&) = delete;
  Context& operator=(const Context&) = delete;

  void* stream() const;
  /// Moves later work to `stream`. Waits for the work already enqueued on the old stream first
  /// (the scratch is reused in stream order), so no ordering is lost.
  void set_stream(void* stream);
  /// Blocks the calling thread until the stream's work is done.
  void synchronize() const;
  /// The device this context (and everything allocated for it) lives on.
  int device() const;

  struct Impl;
  Impl& impl() const { return *impl_; }

 private:
  std::unique_ptr<Impl> impl_;
};

/// Enqueues a host → device copy. `src` may be pageable: the runtime stages it before returning,
/// so the caller may reuse it at once.
void copy_to_device(Context& ctx, void* dst, const void* src, size_t bytes);
/// Device → host copy after the stream's earlier work; SYNCHRONISES the stream, so `dst` holds
/// the data on return.
void copy_to_host(Context& ctx, void* dst, const void* src, size_t bytes);
/// Enqueues dst[0, bytes) = 0.
void fill_zero(Context& ctx, void* dst, size_t bytes);

/// y[N, out] = x[N, in] · w[in, out] + b[out] (b may be null).
void linear_forward(Context& ctx, const float* x, const float* w, const float* b, float* y,
                    int64_t n, int64_t in, int64_t out);
/// dx[N, in] = dy · wᵀ (overwritten, skipped if dx is null); dw += xᵀ · dy; db += Σ rows of dy
/// (skipped if db is null).
void linear_backward(Context& ctx, const float* x, const float* w, const float* dy, float* dx,
                     float* dw, float* db, int64_t n, int64_t in, int64_t out);

/// Layer norm over C channels per row: y = (x − mean) · rstd · g + b; saves mean and rstd per row.
void layernorm_forward(Context& ctx, const float* x, const float* g, const float* b, float* y,
                       float* mean, float* rstd, int64_t n, int64_t c);
/// dx += ∂L/∂x (accumulates: the input is a residual stream); dg, db accumulate. dy must not
/// alias dx.
void layernorm_backward(Context& ctx, const float* x, const float* g, const float* mean,
                        const float* rstd, const float* dy, float* dx, float* dg, float* db,
                        int64_t n, int64_t c);

/// GELU, tanh approximation (GPT-2's), element-wise on n values.
void gelu_forward(Context& ctx, const float* x, float* y, int64_t n);
/// dx = gelu'(x) · dy (overwritten).
void gelu_backward(Context& ctx, const float* x, const float* dy, float* dx, int64_t n);

/// Causal multi-head self-attention, as ops::attention_forward: qkv [B·T, 3C], y [B·T, C],
/// probs [B, H, T, T] (zero above the diagonal). One strided-batched SGEMM per sequence.
void attention_forward(Context& ctx, const float* qkv, float* y, float* probs, int64_t batch,
                       int64_t t, int64_t c, int64_t heads);
/// dqkv = ∂L/∂qkv (overwritten). Unlike the CPU version, scratch needs batch·heads·T·T floats
/// (one T×T block per sequence and head, so the whole batch's softmax backward is one launch).
void attention_backward(Context& ctx, const float* qkv, const float* probs, const float* dy,
                        float* dqkv, float* scratch, int64_t batch, int64_t t, int64_t c,
                        int64_t heads);

/// Mean cross-entropy of logits [N, V] against targets (device int32, each in [0, V)); overwrites
/// logits with the softmax and writes the mean loss over the N rows (summed in double, in a fixed
/// order) to the device double `*mean_loss`. Asynchronous: read the loss after the stream has
/// reached this point. Uses the context's scratch (N doubles).
void softmax_cross_entropy_async(Context& ctx, float* logits, const int32_t* targets, int64_t n,
                                 int64_t v, double* mean_loss);
/// As softmax_cross_entropy_async, then copies the loss to the host: SYNCHRONISES the stream and
/// returns the mean loss, like ops::softmax_cross_entropy.
double softmax_cross_entropy(Context& ctx, float* logits, const int32_t* targets, int64_t n,
                             int64_t v);
/// dlogits = (softmax − onehot(target)) · scale / N, computed in place from the softmax.
void softmax_cross_entropy_backward(Context& ctx, float* probs_to_dlogits, const int32_t* targets,
                                    int64_t n, int64_t v, float scale);

// The model's glue, the GPU side of loops that gpt.cpp runs inline on the CPU.

/// y[i] += x[i] for n values (the residual connections).
void add_inplace(Context& ctx, float* y, const float* x, int64_t n);
/// x[i, :] = wte[tokens[i], :] + wpe[i mod t, :] for n = batch·t rows of c channels.
void embedding_forward(Context& ctx, const int32_t* tokens, const float* wte, const float* wpe,
                       float* x, int64_t n, int64_t t, int64_t c);
/// dwte[v, :] += Σ dx[i, :] over the rows i holding token v, and dwpe[p, :] += Σ dx[i, :] over
/// the rows at position p, each sum in ascending row order (the CPU loop's order, so the result
/// is the same bits). The rows are given grouped by token, as CSR on the device:
/// token_rows[token_offsets[v] .. token_offsets[v + 1]) lists, ascending, the rows holding token
/// v (token_offsets has vocab + 1 entries). No atomics: every output element has one thread.
void embedding_backward(Context& ctx, const int32_t* token_offsets, const int32_t* token_rows,
                        const float* dx, float* dwte, float* dwpe, int64_t n, int64_t t, int64_t c,
                        int64_t vocab);

}  // namespace zsdemo::gpu
