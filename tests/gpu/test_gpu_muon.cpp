// Muon's GPU kernels (kernels/cuda/muon.cu) against the CPU's (kernels/cpu/newton_schulz.hpp):
//   muon_average: BITWISE cpu::muon_average, f32, bf16 and 8-bit momentum, every gradient dtype,
//     with and without Nesterov, on a sub-range with unaligned ends;
//   newton_schulz: in f32 as close to the iteration in float64 as the CPU's is (cuBLAS sums in
//     another order), with bf16 rounding within 3 % of the CPU's, on wide, tall and square
//     matrices, scaled; and orthogonal (X·Xᵀ near the identity's scale), so a no-op or a wrong
//     product fails.
// Without a GPU every case skips.

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "kernels/cpu/cpu_kernels.hpp"
#include "kernels/cpu/newton_schulz.hpp"
#include "kernels/cuda/cuda_kernels.hpp"
#include "src/cuda/cuda_resources.hpp"
#include "tests/gpu/gpu_test_util.hpp"
#include "zeroshard/error.hpp"

namespace zeroshard {
namespace {

using zs_gpu_test::DeviceBytes;
using zs_gpu_test::first_mismatch;

std::vector<float> uniform(std::mt19937& rng, size_t n, float lo, float hi) {
  std::uniform_real_distribution<float> d(lo, hi);
  std::vector<float> v(n);
  for (float& x : v) x = d(rng);
  return v;
}

// cpu::newton_schulz's iteration in float64 (no bf16), then scaled.
std::vector<double> newton_schulz_f64(const std::vector<float>& x0, int64_t rows, int64_t cols,
                                      const cpu::NsOptions& o) {
  const bool tall = rows > cols;
  const int64_t m = tall ? cols : rows, n = tall ? rows : cols;
  std::vector<double> X(size_t(m * n)), A(size_t(m * m)), B(size_t(m * m)), Y(size_t(m * n));
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = 0; j < cols; ++j)
      X[size_t(tall ? j * n + i : i * n + j)] = double(x0[size_t(i * cols + j)]);
  double ss = 0;
  for (double v : X) ss += v * v;
  const double inv = std::max(std::sqrt(ss), double(o.eps));
  for (double& v : X) v /= inv;
  for (int step = 0; step < o.steps; ++step) {
    for (int64_t i = 0; i < m; ++i)
      for (int64_t j = 0; j < m; ++j) {
        double t = 0;
        for (int64_t k = 0; k < n; ++k) t += X[size_t(i * n + k)] * X[size_t(j * n + k)];
        A[size_t(i * m + j)] = t;
      }
    for (int64_t i = 0; i < m; ++i)
      for (int64_t j = 0; j < m; ++j) {
        double t = 0;
        for (int64_t k = 0; k < m; ++k) t += A[size_t(i * m + k)] * A[size_t(k * m + j)];
        B[size_t(i * m + j)] = double(cpu::kNsB) * A[size_t(i * m + j)] + double(cpu::kNsC) * t;
      }
    for (int64_t i = 0; i < m; ++i)
      for (int64_t j = 0; j < n; ++j) {
        double t = 0;
        for (int64_t k = 0; k < m; ++k) t += B[size_t(i * m + k)] * X[size_t(k * n + j)];
        Y[size_t(i * n + j)] = double(cpu::kNsA) * X[size_t(i * n + j)] + t;
      }
    std::swap(X, Y);
  }
  std::vector<double> out(size_t(rows * cols));
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = 0; j < cols; ++j)
      out[size_t(i * cols + j)] = X[size_t(tall ? j * n + i : i * n + j)] * double(o.scale);
  return out;
}

class GpuMuon : public ::testing::Test {
 protected:
  void SetUp() override { ZS_REQUIRE_GPU(); }
};

TEST_F(GpuMuon, AverageMatchesCpuBitwise) {
  const int64_t n = 3000, block = 256, lo = 5, hi = 2711;
  std::mt19937 rng(3);
  const std::vector<float> g = uniform(rng, size_t(n), -3.0f, 3.0f);
  const std::vector<float> m = uniform(rng, size_t(n), -0.2f, 0.2f);
  for (StateFormat f : {StateFormat::f32, StateFormat::bf16, StateFormat::q8})
    for (DType gd : {DType::f32, DType::bf16, DType::f16})
      for (bool nesterov : {false, true}) {
        SCOPED_TRACE(std::string(state_format_name(f)) + " grad " + dtype_name(gd) +
                     (nesterov ? " nesterov" : ""));
        std::vector<unsigned char> grad(size_t(n) * dtype_size(gd));
        cpu::convert(cpu::Isa::scalar, g.data(), DType::f32, grad.data(), gd, n);
        std::vector<unsigned char> state(size_t(n) * cpu::state_bytes(f));
        std::vector<float> absmax(size_t((n + block - 1) / block));
        cpu::narrow_moment(cpu::Isa::scalar, f, m.data(), n, block, true, state.data(),
                           absmax.data());
        cpu::UpdateHyper h;
        h.kind = OptimizerKind::muon;
        h.momentum = 0.95f;
        h.nesterov = nesterov;
        h.grad_scale = 0.37f;
        cpu::UpdateArgs a;
        a.grad = grad.data();
        a.grad_dtype = gd;
        a.state0 = state.data();
        a.state_format = f;
        a.absmax0 = f == StateFormat::q8 ? absmax.data() : nullptr;
        a.block = block;
        a.n = n;
        std::vector<float> want(size_t(hi - lo)), wide;
        cpu::muon_average(cpu::Isa::scalar, a, h, lo, hi, want.data(), wide);

        DeviceBytes dg(grad), ds(state), da(absmax), dd(std::vector<float>(size_t(hi - lo), 7.0f));
        cpu::UpdateArgs ga = a;
        ga.grad = dg.data();
        ga.state0 = ds.data();
        ga.absmax0 = f == StateFormat::q8 ? da.as<float>() : nullptr;
        cuda::Stream stream(0);
        cuda::muon_average(ga, h, lo, hi, dd.as<float>(), stream.handle());
        stream.synchronize();
        const std::vector<float> got = dd.download<float>();
        EXPECT_EQ(first_mismatch(DType::f32, got.data(), want.data(), hi - lo), -1);
        EXPECT_NE(got[0], 7.0f);
      }
}

TEST_F(GpuMuon, NewtonSchulzIsTheCpusIterationOnCublas) {
  struct Shape {
    int64_t rows, cols;
  };
  void* blas = cuda::create_blas();
  DeviceBytes sums(2 * sizeof(double)), work(cuda::kSumSquaresWorkspaceBytes);
  for (Shape s : {Shape{64, 160}, Shape{160, 64}, Shape{96, 96}, Shape{1, 33}})
    for (bool bf16 : {false, true}) {
      SCOPED_TRACE(std::to_string(s.rows) + " x " + std::to_string(s.cols) +
                   (bf16 ? " bf16" : " f32"));
      std::mt19937 rng(uint32_t(s.rows * 7 + s.cols));
      const std::vector<float> x = uniform(rng, size_t(s.rows * s.cols), -1.0f, 1.0f);
      const cpu::NsOptions o{5, 1e-7f, bf16, 1.5f};
      std::vector<float> want = x;
      std::vector<float> scratch(size_t(cpu::newton_schulz_scratch(s.rows, s.cols)));
      cpu::newton_schulz(want.data(), s.rows, s.cols, o.steps, o.eps, o.bf16, scratch.data());
      for (float& v : want) v *= o.scale;

      DeviceBytes dx(x), ds(std::vector<float>(scratch.size()));
      cuda::Stream stream(0);
      cuda::newton_schulz(dx.as<float>(), s.rows, s.cols, o, ds.as<float>(), sums.as<double>(),
                          work.data(), blas, stream.handle());
      stream.synchronize();
      const std::vector<float> got = dx.download<float>();
      double top = 0;
      for (float v : want) top = std::max(top, double(std::fabs(v)));
      if (!bf16) {
        // f32: the GPU's error against the iteration in float64 is of the CPU's own size (the
        // same products summed in another order); a NaN fails.
        const std::vector<double> exact = newton_schulz_f64(x, s.rows, s.cols, o);
        double cpu_err = 0, gpu_err = 0;
        for (size_t i = 0; i < got.size(); ++i) {
          cpu_err = std::max(cpu_err, std::fabs(double(want[i]) - exact[i]));
          const double e = std::fabs(double(got[i]) - exact[i]);
          gpu_err = std::isnan(e) ? INFINITY : std::max(gpu_err, e);
        }
        EXPECT_LE(gpu_err, 8 * cpu_err + 1e-6 * top) << "CPU's error " << cpu_err;
      } else {
        // bf16: a rounding may go the other way where the sums differ in their last bits.
        int64_t off = 0;
        for (size_t i = 0; i < got.size(); ++i)
          off += !(std::fabs(double(got[i]) - double(want[i])) <= 3e-2 * top);
        EXPECT_EQ(off, 0);
      }
      // The rows (of the wide form) are near-orthonormal, times the scale: the Gram matrix's
      // diagonal is about scale², its off-diagonal small (the quintic leaves 0.7–1.2).
      const bool tall = s.rows > s.cols;
      const int64_t m = tall ? s.cols : s.rows, n = tall ? s.rows : s.cols;
      const auto at = [&](int64_t r, int64_t c) {
        return double(tall ? got[size_t(c * s.cols + r)] : got[size_t(r * s.cols + c)]);
      };
      for (int64_t r = 0; r < m; ++r) {
        double d = 0;
        for (int64_t c = 0; c < n; ++c) d += at(r, c) * at(r, c);
        EXPECT_GT(d / (1.5 * 1.5), 0.4) << "row " << r;
        EXPECT_LT(d / (1.5 * 1.5), 1.6) << "row " << r;
      }
    }
  cuda::destroy_blas(blas);
}

TEST(GpuMuonArgs, RefusedWithoutAGpu) {
  cpu::UpdateArgs a;
  a.n = 10;
  cpu::UpdateHyper h;
  float d = 0;
  EXPECT_THROW(cuda::muon_average(a, h, 0, 10, &d, nullptr), Error);  // null arrays
  EXPECT_THROW(
      cuda::newton_schulz(&d, 0, 4, cpu::NsOptions{}, &d, nullptr, nullptr, nullptr, nullptr),
      Error);
}

}  // namespace
}  // namespace zeroshard
