#include "apps/model/ops.hpp"

#ifdef ZSDEMO_HAVE_BLAS
#include <cblas.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstring>

namespace zsdemo::ops {
namespace {

// Row-major C[m, n] = alpha · op(A) · op(B) + beta · C with explicit leading dimensions, which
// lets attention address one head's columns inside the fused qkv matrix without copies.
void gemm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha, const float* a,
          int64_t lda, const float* b, int64_t ldb, float beta, float* c, int64_t ldc) {
#ifdef ZSDEMO_HAVE_BLAS
  cblas_sgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans,
              static_cast<int>(m), static_cast<int>(n), static_cast<int>(k), alpha, a,
              static_cast<int>(lda), b, static_cast<int>(ldb), beta, c, static_cast<int>(ldc));
#else
  // BLAS semantics: beta = 0 never reads C.
  for (int64_t i = 0; i < m; ++i) {
    float* ci = c + i * ldc;
    for (int64_t j = 0; j < n; ++j) ci[j] = beta == 0 ? 0.0f : beta * ci[j];
    for (int64_t p = 0; p < k; ++p) {
      const float av = alpha * (ta ? a[p * lda + i] : a[i * lda + p]);
      if (tb)
        for (int64_t j = 0; j < n; ++j) ci[j] += av * b[j * ldb + p];
      else
        for (int64_t j = 0; j < n; ++j) ci[j] += av * b[p * ldb + j];
    }
  }
#endif
}

constexpr float kGeluK = 0.7978845608028654f;  // sqrt(2 / pi)
constexpr float kGeluC = 0.044715f;

// exp(x) to about 2 ulp for x in [-87, 88], in plain arithmetic that the compiler vectorises
// (libm's tanhf/expf are scalar calls, and GELU runs on 4·C values per token: it dominated the
// profile at a third of the step). exp(x) = 2^n · e^r with n = round(x / ln 2), |r| ≤ ln2 / 2.
inline float fast_exp(float x) {
  x = std::min(88.0f, std::max(-87.0f, x));
  constexpr float kMagic = 12582912.0f;  // 1.5 · 2^23: adding it rounds to an integer
  const float n = (x * 1.44269504f + kMagic) - kMagic;
  const float r = (x - n * 0.693145752f) - n * 1.42860677e-6f;  // Cody–Waite ln 2 split
  // Taylor polynomial to r^7/7!: truncation error below 2e-8 relative on |r| ≤ ln2 / 2.
  float p = 1.0f / 5040.0f;
  p = p * r + 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

// tanh(u) = 1 − 2 / (e^{2u} + 1): exact limits ±1, no cancellation problem for GELU's use.
inline float fast_tanh(float u) {
  return 1.0f - 2.0f / (fast_exp(2.0f * u) + 1.0f);
}

}  // namespace

void linear_forward(const float* x, const float* w, const float* b, float* y, int64_t n, int64_t in,
                    int64_t out) {
  // Broadcast the bias first, then let sgemm add x·w on top (beta = 1): one pass over y.
  if (b) {
    for (int64_t r = 0; r < n; ++r) std::copy(b, b + out, y + r * out);
  }
  gemm(false, false, n, out, in, 1.0f, x, in, w, out, b ? 1.0f : 0.0f, y, out);
}

void linear_backward(const float* x, const float* w, const float* dy, float* dx, float* dw,
                     float* db, int64_t n, int64_t in, int64_t out) {
  if (dx) gemm(false, true, n, in, out, 1.0f, dy, out, w, out, 0.0f, dx, in);
  gemm(true, false, in, out, n, 1.0f, x, in, dy, out, 1.0f, dw, out);
  if (db) {
    for (int64_t r = 0; r < n; ++r) {
      const float* row = dy + r * out;
      for (int64_t j = 0; j < out; ++j) db[j] += row[j];
    }
  }
}

void layernorm_forward(const float* x, const float* g, const float* b, float* y, float* mean,
                       float* rstd, int64_t n, int64_t c) {
  constexpr float kEps = 1e-5f;
  for (int64_t r = 0; r < n; ++r) {
    const float* xr = x + r * c;
    float* yr = y + r * c;
    // Two passes (mean, then centred variance): stable for rows with a large mean.
    double s = 0;
    for (int64_t j = 0; j < c; ++j) s += xr[j];
    const float m = static_cast<float>(s / double(c));
    double v = 0;
    for (int64_t j = 0; j < c; ++j) v += double(xr[j] - m) * double(xr[j] - m);
    const float rs = 1.0f / std::sqrt(static_cast<float>(v / double(c)) + kEps);
    for (int64_t j = 0; j < c; ++j) yr[j] = (xr[j] - m) * rs * g[j] + b[j];
    mean[r] = m;
    rstd[r] = rs;
  }
}

void layernorm_backward(const float* x, const float* g, const float* mean, const float* rstd,
                        const float* dy, float* dx, float* dg, float* db, int64_t n, int64_t c) {
  for (int64_t r = 0; r < n; ++r) {
    const float* xr = x + r * c;
    const float* dyr = dy + r * c;
    float* dxr = dx + r * c;
    const float m = mean[r], rs = rstd[r];
    // dx = rstd · (dn − mean(dn) − x̂ · mean(dn · x̂)), with dn = dy · g and x̂ the normalised x.
    float mean_dn = 0, mean_dn_xh = 0;
    for (int64_t j = 0; j < c; ++j) {
      const float xh = (xr[j] - m) * rs, dn = dyr[j] * g[j];
      mean_dn += dn;
      mean_dn_xh += dn * xh;
      db[j] += dyr[j];
      dg[j] += xh * dyr[j];
    }
    mean_dn /= static_cast<float>(c);
    mean_dn_xh /= static_cast<float>(c);
    for (int64_t j = 0; j < c; ++j) {
      const float xh = (xr[j] - m) * rs;
      dxr[j] += rs * (dyr[j] * g[j] - mean_dn - xh * mean_dn_xh);
    }
  }
}

void gelu_forward(const float* x, float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float v = x[i];
    y[i] = 0.5f * v * (1.0f + fast_tanh(kGeluK * (v + kGeluC * v * v * v)));
  }
}

void gelu_backward(const float* x, const float* dy, float* dx, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float v = x[i];
    const float t = fast_tanh(kGeluK * (v + kGeluC * v * v * v));
    const float d =
        0.5f * (1.0f + t) + 0.5f * v * (1.0f - t * t) * kGeluK * (1.0f + 3.0f * kGeluC * v * v);
    dx[i] = d * dy[i];
  }
}

void attention_forward(const float* qkv, float* y, float* probs, int64_t batch, int64_t t,
                       int64_t c, int64_t heads) {
  const int64_t hd = c / heads, ld = 3 * c;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t h = 0; h < heads; ++h) {
      const float* q = qkv + b * t * ld + h * hd;
      const float* k = q + c;
      const float* v = q + 2 * c;
      float* p = probs + (b * heads + h) * t * t;
      // Scores for every (query, key) pair in one sgemm; the masked upper triangle is cheaper
      // to compute and ignore than to skip at these sizes.
      gemm(false, true, t, t, hd, scale, q, ld, k, ld, 0.0f, p, t);
      for (int64_t i = 0; i < t; ++i) {
        float* row = p + i * t;
        float mx = row[0];
        for (int64_t j = 1; j <= i; ++j) mx = std::max(mx, row[j]);
        float sum = 0;
        for (int64_t j = 0; j <= i; ++j) {
          row[j] = std::exp(row[j] - mx);
          sum += row[j];
        }
        const float inv = 1.0f / sum;
        for (int64_t j = 0; j <= i; ++j) row[j] *= inv;
        for (int64_t j = i + 1; j < t; ++j) row[j] = 0.0f;
      }
      gemm(false, false, t, hd, t, 1.0f, p, t, v, ld, 0.0f, y + b * t * c + h * hd, c);
    }
  }
}

void attention_backward(const float* qkv, const float* probs, const float* dy, float* dqkv,
                        float* scratch, int64_t batch, int64_t t, int64_t c, int64_t heads) {
  const int64_t hd = c / heads, ld = 3 * c;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t h = 0; h < heads; ++h) {
      const int64_t off = b * t * ld + h * hd;
      const float* q = qkv + off;
      const float* k = q + c;
      const float* v = q + 2 * c;
      float* dq = dqkv + off;
      float* dk = dq + c;
      float* dv = dq + 2 * c;
      const float* p = probs + (b * heads + h) * t * t;
      const float* dyh = dy + b * t * c + h * hd;
      float* ds = scratch;
      // dP = dY·Vᵀ and dV = Pᵀ·dY.
      gemm(false, true, t, t, hd, 1.0f, dyh, c, v, ld, 0.0f, ds, t);
      gemm(true, false, t, hd, t, 1.0f, p, t, dyh, c, 0.0f, dv, ld);
      // Softmax backward per row: dS = P ⊙ (dP − Σ_j dP·P); masked entries have P = 0.
      for (int64_t i = 0; i < t; ++i) {
        const float* pr = p + i * t;
        float* dr = ds + i * t;
        float dot = 0;
        for (int64_t j = 0; j <= i; ++j) dot += pr[j] * dr[j];
        for (int64_t j = 0; j <= i; ++j) dr[j] = pr[j] * (dr[j] - dot);
        for (int64_t j = i + 1; j < t; ++j) dr[j] = 0.0f;
      }
      // S = scale · Q·Kᵀ, so dQ = scale · dS·K and dK = scale · dSᵀ·Q.
      gemm(false, false, t, hd, t, scale, ds, t, k, ld, 0.0f, dq, ld);
      gemm(true, false, t, hd, t, scale, ds, t, q, ld, 0.0f, dk, ld);
    }
  }
}

double softmax_cross_entropy(float* logits, const int32_t* targets, int64_t n, int64_t v) {
  double loss = 0;
  for (int64_t r = 0; r < n; ++r) {
    float* row = logits + r * v;
    const float mx = *std::max_element(row, row + v);
    const float target_logit = row[targets[r]];
    double sum = 0;
    for (int64_t j = 0; j < v; ++j) {
      row[j] = std::exp(row[j] - mx);
      sum += row[j];
    }
    const float inv = static_cast<float>(1.0 / sum);
    for (int64_t j = 0; j < v; ++j) row[j] *= inv;
    // −log p[target] from log-sum-exp: finite even where the probability underflows to 0.
    loss += std::log(sum) + double(mx) - double(target_logit);
  }
  return loss / double(n);
}

void softmax_cross_entropy_backward(float* probs_to_dlogits, const int32_t* targets, int64_t n,
                                    int64_t v, float scale) {
  const float f = scale / static_cast<float>(n);
  for (int64_t r = 0; r < n; ++r) {
    float* row = probs_to_dlogits + r * v;
    for (int64_t j = 0; j < v; ++j) row[j] *= f;
    row[targets[r]] -= f;
  }
}

void add_inplace(float* y, const float* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] += x[i];
}

}  // namespace zsdemo::ops
