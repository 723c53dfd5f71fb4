#pragma once
// The demo model's layers, forward and backward, in f32 on row-major matrices. Matrix products
// go to BLAS (cblas_sgemm); the rest are plain loops. Backward functions ADD into the gradients
// of parameters (the caller zeroes them once per micro-step) and overwrite input gradients
// unless they say otherwise, so one buffer can collect the gradient of a residual stream.
//
// Shapes: N rows (tokens = batch × sequence), C columns (channels). Weights are stored
// [in, out], so y = x·W + b.

#include <cstdint>

namespace zsdemo::ops {

/// y[N, out] = x[N, in] · w[in, out] + b[out] (b may be null).
void linear_forward(const float* x, const float* w, const float* b, float* y, int64_t n, int64_t in,
                    int64_t out);
/// dx[N, in] = dy · wᵀ (overwritten, skipped if dx is null); dw += xᵀ · dy; db += Σ rows of dy.
void linear_backward(const float* x, const float* w, const float* dy, float* dx, float* dw,
                     float* db, int64_t n, int64_t in, int64_t out);

/// Layer norm over C channels per row: y = (x − mean) · rstd · g + b; saves mean and rstd per row.
void layernorm_forward(const float* x, const float* g, const float* b, float* y, float* mean,
                       float* rstd, int64_t n, int64_t c);
/// dx += ∂L/∂x (accumulates: the input is a residual stream); dg, db accumulate.
void layernorm_backward(const float* x, const float* g, const float* mean, const float* rstd,
                        const float* dy, float* dx, float* dg, float* db, int64_t n, int64_t c);

/// GELU, tanh approximation (GPT-2's), element-wise on n values.
void gelu_forward(const float* x, float* y, int64_t n);
/// dx = gelu'(x) · dy (overwritten).
void gelu_backward(const float* x, const float* dy, float* dx, int64_t n);

/// Causal multi-head self-attention. qkv is [B·T, 3C] holding q, k, v side by side; head h uses
/// columns [h·hd, (h+1)·hd) of each. y is [B·T, C]; probs [B, H, T, T] keeps the softmax for
/// backward (zero above the diagonal).
void attention_forward(const float* qkv, float* y, float* probs, int64_t batch, int64_t t,
                       int64_t c, int64_t heads);
/// dqkv = ∂L/∂qkv (overwritten); scratch needs T·T floats.
void attention_backward(const float* qkv, const float* probs, const float* dy, float* dqkv,
                        float* scratch, int64_t batch, int64_t t, int64_t c, int64_t heads);

/// Mean cross-entropy of logits [N, V] against targets; overwrites logits with the softmax.
/// Returns the mean loss over the N rows (accumulated in double).
double softmax_cross_entropy(float* logits, const int32_t* targets, int64_t n, int64_t v);
/// dlogits = (softmax − onehot(target)) · scale / N, computed in place from the softmax.
void softmax_cross_entropy_backward(float* probs_to_dlogits, const int32_t* targets, int64_t n,
                                    int64_t v, float scale);

/// y[i] += x[i] for n values (the residual connections).
void add_inplace(float* y, const float* x, int64_t n);

}  // namespace zsdemo::ops
