// Muon's kernels on the CPU (newton_schulz.hpp).
#include "kernels/cpu/newton_schulz.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "kernels/cpu/cpu_kernels.hpp"

#ifdef ZS_HAVE_BLAS
#include <cblas.h>
#endif

namespace zeroshard::cpu {

namespace {

// c = alpha·a·op(b) + beta·c with a (m × k), op(b) (k × n) and c (m × n), row-major; op(b) is
// bᵀ when `bt` (b then is n × k).
void gemm(int64_t m, int64_t n, int64_t k, float alpha, const float* a, const float* b, bool bt,
          float beta, float* c) {
#ifdef ZS_HAVE_BLAS
  cblas_sgemm(CblasRowMajor, CblasNoTrans, bt ? CblasTrans : CblasNoTrans, int(m), int(n), int(k),
              alpha, a, int(k), b, bt ? int(k) : int(n), beta, c, int(n));
#else
  std::vector<float> row(size_t(n));
  for (int64_t i = 0; i < m; ++i) {
    std::fill(row.begin(), row.end(), 0.0f);
    for (int64_t p = 0; p < k; ++p) {
      const float av = a[i * k + p];
      if (bt) {
        for (int64_t j = 0; j < n; ++j) row[size_t(j)] += av * b[j * k + p];
      } else {
        const float* br = b + p * n;
        for (int64_t j = 0; j < n; ++j) row[size_t(j)] += av * br[j];
      }
    }
    float* cr = c + i * n;
    for (int64_t j = 0; j < n; ++j) cr[j] = alpha * row[size_t(j)] + (beta == 0 ? 0 : beta * cr[j]);
  }
#endif
}

void round_bf16(float* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) x[i] = bf16_to_float(float_to_bf16(x[i]));
}

}  // namespace

void muon_average(Isa isa, const UpdateArgs& a, const UpdateHyper& h, int64_t lo, int64_t hi,
                  float* d, std::vector<float>& wide) {
  if (lo >= hi) return;
  const bool q8 = a.state_format == StateFormat::q8;
  const int64_t blo = q8 ? lo / a.block * a.block : lo;
  const int64_t bhi = q8 ? std::min(a.n, (hi + a.block - 1) / a.block * a.block) : hi;
  wide.resize(size_t(bhi - blo));
  const size_t sb = state_bytes(a.state_format);
  widen_moment(isa, a.state_format, static_cast<const char*>(a.state0) + size_t(blo) * sb,
               a.absmax0 ? a.absmax0 + blo / a.block : nullptr, bhi - blo, a.block, true,
               wide.data());
  convert(isa, static_cast<const char*>(a.grad) + size_t(lo) * dtype_size(a.grad_dtype),
          a.grad_dtype, d, DType::f32, hi - lo);
  const float omm = 1.0f - h.momentum;
  for (int64_t i = 0; i < hi - lo; ++i) {
    const float g = d[i] * h.grad_scale;
    const float buf = h.momentum * wide[size_t(lo - blo + i)] + omm * g;
    d[i] = h.nesterov ? omm * g + h.momentum * buf : buf;
  }
}

bool newton_schulz_uses_blas() {
#ifdef ZS_HAVE_BLAS
  return true;
#else
  return false;
#endif
}

double newton_schulz_cost(int64_t rows, int64_t cols, int steps) {
  const double m = double(std::min(rows, cols)), n = double(std::max(rows, cols));
  // X·Xᵀ (m²n), A·A (m³), B·X (m²n) per step.
  return double(steps) * (2 * m * m * n + m * m * m);
}

std::vector<int> assign_owners(const std::vector<double>& cost, std::vector<double>& load) {
  std::vector<size_t> order(cost.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(),
                   [&](size_t a, size_t b) { return cost[a] > cost[b]; });
  std::vector<double> here(load.size(), 0.0);
  std::vector<int> owner(cost.size(), 0);
  for (size_t i : order) {
    size_t best = 0;
    for (size_t r = 1; r < load.size(); ++r)
      if (std::make_pair(here[r], load[r]) < std::make_pair(here[best], load[best])) best = r;
    owner[i] = int(best);
    here[best] += cost[i];
    load[best] += cost[i];
  }
  return owner;
}

void newton_schulz(float* x, int64_t rows, int64_t cols, int steps, float eps, bool bf16,
                   float* scratch) {
  const bool tall = rows > cols;
  const int64_t m = tall ? cols : rows, n = tall ? rows : cols;
  float* X = scratch;
  float* Y = X + m * n;
  float* A = Y + m * n;
  float* B = A + m * m;
  if (tall) {
    for (int64_t i = 0; i < rows; ++i)
      for (int64_t j = 0; j < cols; ++j) X[j * n + i] = x[i * cols + j];
  } else {
    std::memcpy(X, x, size_t(m * n) * sizeof(float));
  }
  if (bf16) round_bf16(X, m * n);
  double ss = 0;
  for (int64_t i = 0; i < m * n; ++i) ss += double(X[i]) * double(X[i]);
  float norm = float(std::sqrt(ss));
  if (bf16) norm = bf16_to_float(float_to_bf16(norm));
  const float inv = std::max(norm, eps);
  for (int64_t i = 0; i < m * n; ++i) X[i] = X[i] / inv;
  if (bf16) round_bf16(X, m * n);
  for (int s = 0; s < steps; ++s) {
    gemm(m, m, n, 1.0f, X, X, true, 0.0f, A);  // A = X·Xᵀ
    if (bf16) round_bf16(A, m * m);
    std::memcpy(B, A, size_t(m * m) * sizeof(float));
    gemm(m, m, m, kNsC, A, A, false, kNsB, B);  // B = b·A + c·A·A
    if (bf16) round_bf16(B, m * m);
    std::memcpy(Y, X, size_t(m * n) * sizeof(float));
    gemm(m, n, m, 1.0f, B, X, false, kNsA, Y);  // Y = a·X + B·X
    if (bf16) round_bf16(Y, m * n);
    std::swap(X, Y);
  }
  if (tall) {
    for (int64_t i = 0; i < rows; ++i)
      for (int64_t j = 0; j < cols; ++j) x[i * cols + j] = X[j * n + i];
  } else {
    std::memcpy(x, X, size_t(m * n) * sizeof(float));
  }
}

}  // namespace zeroshard::cpu
