// Muon's GPU kernels (kernels/cuda/muon.cu) against the CPU's (kernels/cpu/newton_schulz.hpp):
//   muon_average: BITWISE cpu::muon_average, f32, bf16 and 8-bit momentum, every gradient dtype,
//     with and without Nesterov, on a sub-range with unaligned ends;
//   newton_schulz: close to cpu::newton_schulz (cuBLAS sums in another order) on wide, tall and
//     square matrices, in f32 and with bf16 rounding, scaled; and orthogonal (X·Xᵀ near the
//     identity's scale), so a no-op or a wrong product fails.
// Without a GPU every case skips.

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <string>
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
      double worst = 0, top = 0;
      for (size_t i = 0; i < got.size(); ++i) {
        worst = std::max(worst, double(std::fabs(got[i] - want[i])));
        top = std::max(top, double(std::fabs(want[i])));
      }
      // f32: the same products summed in another order; bf16: a rounding may go the other way.
      EXPECT_LE(worst, (bf16 ? 3e-2 : 1e-4) * top) << "largest |GPU - CPU| " << worst;
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
