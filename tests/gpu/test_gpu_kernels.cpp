// CUDA kernels against the CPU kernels (the scalar reference of kernels/cpu/cpu_kernels.hpp):
//   optimizer_update, convert, accumulate: BITWISE equal (NaN results: NaN on both sides), on
//     random data with awkward values, lengths with tails, runs with unaligned ends and gaps;
//   sum_squares_nonfinite: within 1e-12 relative of the CPU and of a long-double sum (the
//     summation order differs), bitwise reproducible, independent of alignment, and the flag
//     set exactly when a value is inf or NaN.
// Every comparison also checks that the kernel changed what it should (a no-op fails).
// Argument validation needs no GPU and runs everywhere; the rest skips without one.

#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "kernels/cpu/cpu_kernels.hpp"
#include "kernels/cuda/cuda_kernels.hpp"
#include "src/cuda/cuda_resources.hpp"
#include "tests/gpu/gpu_test_util.hpp"
#include "zeroshard/error.hpp"

namespace zeroshard {
namespace {

using zs_gpu_test::DeviceBytes;
using zs_gpu_test::first_mismatch;

constexpr DType kDTypes[] = {DType::f32, DType::bf16, DType::f16};

float from_bits(uint32_t u) {
  return std::bit_cast<float>(u);
}

// Host bytes of n elements of dtype d holding `values` converted exactly as the CPU converts.
std::vector<unsigned char> encode(DType d, const std::vector<float>& values) {
  std::vector<unsigned char> out(values.size() * dtype_size(d));
  for (size_t i = 0; i < values.size(); ++i) {
    if (d == DType::f32) {
      std::memcpy(&out[i * 4], &values[i], 4);
    } else {
      const uint16_t h =
          d == DType::bf16 ? cpu::float_to_bf16(values[i]) : cpu::float_to_f16(values[i]);
      std::memcpy(&out[i * 2], &h, 2);
    }
  }
  return out;
}

std::vector<float> uniform(std::mt19937& rng, size_t n, float lo, float hi) {
  std::uniform_real_distribution<float> dist(lo, hi);
  std::vector<float> v(n);
  for (float& x : v) x = dist(rng);
  return v;
}

// Sprinkles awkward values: signed zeros, subnormals, values at bf16/f16 rounding ties and
// around the f16 overflow threshold (65504 / 65520), and optionally inf and NaN.
void sprinkle(std::vector<float>& v, bool non_finite) {
  static const uint32_t finite[] = {0x00000000u, 0x80000000u, 0x00000001u, 0x807FFFFFu,
                                    0x3F808000u, 0x3F818000u, 0x477FE000u, 0x477FF000u,
                                    0x477FEFFFu, 0x33800000u};
  static const uint32_t special[] = {0x7F800000u, 0xFF800000u, 0x7FC00000u};
  for (size_t i = 5, k = 0; i < v.size(); i += 37, ++k)
    v[i] = from_bits(finite[k % std::size(finite)]);
  if (non_finite)
    for (size_t i = 11, k = 0; i < v.size(); i += 211, ++k)
      v[i] = from_bits(special[k % std::size(special)]);
}

// ---- optimizer_update -------------------------------------------------------------------------

struct UpdateCase {
  OptimizerKind kind;
  float momentum;
  bool nesterov;
  DType grad;
  bool has_out;
  DType out;
};

std::string case_name(const UpdateCase& c) {
  std::string s = optimizer_name(c.kind);
  if (c.kind == OptimizerKind::sgd)
    s += c.momentum == 0 ? "-plain" : c.nesterov ? "-nesterov" : "-momentum";
  s += std::string("-grad_") + dtype_name(c.grad);
  s += c.has_out ? std::string("-out_") + dtype_name(c.out) : std::string("-no_out");
  return s;
}

std::vector<cpu::UpdateHyper> hypers_for(const UpdateCase& c) {
  // Three groups with different rates, decays and scales (step 3's bias corrections).
  std::vector<cpu::UpdateHyper> hs;
  const float lrs[] = {1e-3f, 3e-2f, 7e-4f}, wds[] = {0.01f, 0.0f, 0.1f},
              scales[] = {1.0f, 0.37f, 2.5f};
  for (int g = 0; g < 3; ++g) {
    cpu::UpdateHyper h;
    h.kind = c.kind;
    h.lr = lrs[g];
    h.beta1 = c.kind == OptimizerKind::lion ? 0.9f : 0.9f - 0.05f * float(g);
    h.beta2 = c.kind == OptimizerKind::lion ? 0.99f : 0.999f - 0.004f * float(g);
    h.eps = 1e-8f;
    h.weight_decay = wds[g];
    h.momentum = c.momentum;
    h.nesterov = c.nesterov;
    h.bias_correction1 = float(1.0 - std::pow(double(h.beta1), 3.0));
    h.bias_correction2 = float(1.0 - std::pow(double(h.beta2), 3.0));
    h.grad_scale = scales[g];
    hs.push_back(h);
  }
  return hs;
}

// Runs the GPU update and the CPU reference (each run separately through cpu::optimizer_update
// with Isa::scalar) on the same data and compares every array whole, gaps included.
void check_update(const UpdateCase& c, int64_t n, const std::vector<cuda::UpdateRun>& runs,
                  uint32_t seed) {
  SCOPED_TRACE(case_name(c) + " n=" + std::to_string(n) + " runs=" + std::to_string(runs.size()));
  std::mt19937 rng(seed);
  const auto hypers = hypers_for(c);
  std::vector<float> master = uniform(rng, size_t(n), -2.0f, 2.0f);
  sprinkle(master, false);
  // The f16 copy-out overflows past 65504: put a few master values there.
  for (size_t i = 17; i < master.size(); i += 401) master[i] = 65519.0f + float(i % 3);
  std::vector<float> s0 = uniform(rng, size_t(n), -0.1f, 0.1f);
  std::vector<float> s1 = uniform(rng, size_t(n), 0.0f, 0.01f);
  std::vector<float> g = uniform(rng, size_t(n), -3.0f, 3.0f);
  sprinkle(g, true);
  const auto grad = encode(c.grad, g);
  const std::vector<float> dir = uniform(rng, size_t(n), -1.0f, 1.0f);  // Muon's direction
  const bool muon = c.kind == OptimizerKind::muon;
  const DType out_dt = c.has_out ? c.out : DType::f32;
  // The copy-out starts as a recognisable pattern, so untouched gaps can be checked.
  std::vector<unsigned char> out(size_t(n) * dtype_size(out_dt), 0xA5);

  // CPU reference.
  std::vector<float> rm = master, r0 = s0, r1 = s1;
  std::vector<unsigned char> rout = out;
  for (const cuda::UpdateRun& r : runs) {
    cpu::UpdateArgs a;
    a.master = rm.data() + r.begin;
    a.state0 = r0.data() + r.begin;
    a.state1 = r1.data() + r.begin;
    a.grad = grad.data() + size_t(r.begin) * dtype_size(c.grad);
    a.grad_dtype = c.grad;
    a.out = c.has_out ? rout.data() + size_t(r.begin) * dtype_size(out_dt) : nullptr;
    a.out_dtype = out_dt;
    a.dir = muon ? dir.data() + r.begin : nullptr;
    a.n = r.end - r.begin;
    cpu::optimizer_update(cpu::Isa::scalar, hypers[size_t(r.hyper)], a);
  }

  // GPU.
  DeviceBytes dm(master), d0(s0), d1(s1), dg(grad), dout(out), ddir(dir);
  cpu::UpdateArgs a;
  a.master = dm.as<float>();
  a.state0 = d0.as<float>();
  a.state1 = d1.as<float>();
  a.grad = dg.data();
  a.grad_dtype = c.grad;
  a.out = c.has_out ? dout.data() : nullptr;
  a.out_dtype = out_dt;
  a.dir = muon ? ddir.as<float>() : nullptr;
  a.n = n;
  zeroshard::cuda::Stream stream(0);
  cuda::optimizer_update(hypers.data(), int(hypers.size()), runs.data(), int(runs.size()), a,
                         stream.handle());
  stream.synchronize();
  const auto gm = dm.download<float>(), g0 = d0.download<float>(), g1 = d1.download<float>();
  const auto gout = dout.download<unsigned char>();

  EXPECT_EQ(first_mismatch(DType::f32, gm.data(), rm.data(), n), -1) << "master";
  EXPECT_EQ(first_mismatch(DType::f32, g0.data(), r0.data(), n), -1) << "state0";
  EXPECT_EQ(first_mismatch(DType::f32, g1.data(), r1.data(), n), -1) << "state1";
  EXPECT_EQ(first_mismatch(out_dt, gout.data(), rout.data(), n), -1) << "out";
  // Not a no-op: most master values inside runs changed.
  int64_t in_runs = 0, changed = 0;
  for (const auto& r : runs) {
    for (int64_t i = r.begin; i < r.end; ++i) {
      ++in_runs;
      changed +=
          std::bit_cast<uint32_t>(gm[size_t(i)]) != std::bit_cast<uint32_t>(master[size_t(i)]);
    }
  }
  EXPECT_GT(changed, in_runs * 8 / 10) << "the update left most parameters unchanged";
}

std::vector<UpdateCase> all_cases() {
  std::vector<UpdateCase> cases;
  struct Opt {
    OptimizerKind k;
    float mom;
    bool nest;
  };
  const Opt opts[] = {{OptimizerKind::adam, 0, false},    {OptimizerKind::adamw, 0, false},
                      {OptimizerKind::sgd, 0, false},     {OptimizerKind::sgd, 0.9f, false},
                      {OptimizerKind::sgd, 0.9f, true},   {OptimizerKind::lion, 0, false},
                      {OptimizerKind::muon, 0.95f, false}};
  for (const Opt& o : opts)
    for (DType gd : kDTypes) {
      cases.push_back({o.k, o.mom, o.nest, gd, false, DType::f32});
      for (DType od : kDTypes) cases.push_back({o.k, o.mom, o.nest, gd, true, od});
    }
  return cases;
}

class GpuKernels : public ::testing::Test {
 protected:
  void SetUp() override { ZS_REQUIRE_GPU(); }
};

// Every rule × grad dtype × copy-out, one run covering everything (tails only at the end).
TEST_F(GpuKernels, UpdateMatchesCpuWholeRange) {
  for (int64_t n : {int64_t{1}, int64_t{7}, int64_t{8}, int64_t{9}, int64_t{4099}}) {
    for (const UpdateCase& c : all_cases()) check_update(c, n, {{0, n, 0}}, 11u + uint32_t(n));
  }
}

// Several groups: runs with unaligned ends, tiny runs inside one vector, gaps left untouched.
TEST_F(GpuKernels, UpdateMatchesCpuGroupRuns) {
  const int64_t n = 5000;
  const std::vector<cuda::UpdateRun> runs = {
      {3, 1000, 0}, {1000, 1003, 1}, {1010, 1013, 2}, {1013, 3001, 0}, {3001, 4995, 2}};
  for (const UpdateCase& c : all_cases()) check_update(c, n, runs, 7u);
}

// More runs than one launch holds (kMaxRunsPerLaunch), in shuffled order, with a large run too.
TEST_F(GpuKernels, UpdateMatchesCpuManyRuns) {
  std::mt19937 rng(5);
  std::vector<cuda::UpdateRun> runs;
  int64_t pos = 0;
  for (int r = 0; r < 2 * cuda::kMaxRunsPerLaunch + 5; ++r) {
    const int64_t gap = int64_t(rng() % 5), len = int64_t(rng() % 300);
    runs.push_back({pos + gap, pos + gap + len, int(rng() % 3)});
    pos += gap + len;
  }
  runs.push_back({pos, pos + (1 << 20) + 3, 1});
  pos += (1 << 20) + 3;
  std::shuffle(runs.begin(), runs.end(), rng);
  check_update({OptimizerKind::adamw, 0, false, DType::bf16, true, DType::bf16}, pos, runs, 9u);
  check_update({OptimizerKind::sgd, 0.9f, true, DType::f32, true, DType::f16}, pos, runs, 10u);
}

// SGD groups with and without momentum in one unit: two rules, two launches, one call.
TEST_F(GpuKernels, UpdateMixedSgdRules) {
  const UpdateCase c{OptimizerKind::sgd, 0.9f, false, DType::f16, true, DType::bf16};
  auto hypers = hypers_for(c);
  hypers[1].momentum = 0.0f;  // group 1 is plain SGD
  const int64_t n = 3000;
  const std::vector<cuda::UpdateRun> runs = {{0, 1001, 0}, {1001, 2002, 1}, {2002, 3000, 2}};
  std::mt19937 rng(3);
  std::vector<float> master = uniform(rng, n, -1, 1), s0 = uniform(rng, n, -1, 1),
                     g = uniform(rng, n, -1, 1);
  const auto grad = encode(DType::f16, g);
  std::vector<float> rm = master, r0 = s0;
  std::vector<uint16_t> rout(n, 0), out(n, 0);
  for (const auto& r : runs) {
    cpu::UpdateArgs a;
    a.master = rm.data() + r.begin;
    a.state0 = r0.data() + r.begin;
    a.grad = grad.data() + size_t(r.begin) * 2;
    a.grad_dtype = DType::f16;
    a.out = rout.data() + r.begin;
    a.out_dtype = DType::bf16;
    a.n = r.end - r.begin;
    cpu::optimizer_update(cpu::Isa::scalar, hypers[size_t(r.hyper)], a);
  }
  DeviceBytes dm(master), d0(s0), dg(grad), dout(out);
  cpu::UpdateArgs a;
  a.master = dm.as<float>();
  a.state0 = d0.as<float>();
  a.grad = dg.data();
  a.grad_dtype = DType::f16;
  a.out = dout.data();
  a.out_dtype = DType::bf16;
  a.n = n;
  cuda::optimizer_update(hypers.data(), 3, runs.data(), 3, a, nullptr);
  ZS_CUDA_CHECK(cudaDeviceSynchronize());
  const auto gm = dm.download<float>(), g0 = d0.download<float>();
  const auto gout = dout.download<uint16_t>();
  EXPECT_EQ(first_mismatch(DType::f32, gm.data(), rm.data(), n), -1);
  EXPECT_EQ(first_mismatch(DType::f32, g0.data(), r0.data(), n), -1);
  EXPECT_EQ(first_mismatch(DType::bf16, gout.data(), rout.data(), n), -1);
  EXPECT_NE(first_mismatch(DType::f32, gm.data(), master.data(), n), -1);
}

// ---- compact moments: bf16 and 8-bit ------------------------------------------------------------

// The moments of n elements in format f, from f32 values (q8: quantized in blocks of `block`).
struct Moments {
  std::vector<unsigned char> bytes;
  std::vector<float> absmax;
};
Moments narrow(StateFormat f, const std::vector<float>& x, int64_t block, bool is_signed) {
  const int64_t n = int64_t(x.size());
  Moments m;
  m.bytes.resize(size_t(n) * cpu::state_bytes(f));
  if (f == StateFormat::bf16) {
    for (int64_t i = 0; i < n; ++i) {
      const uint16_t h = cpu::float_to_bf16(x[size_t(i)]);
      std::memcpy(&m.bytes[size_t(i) * 2], &h, 2);
    }
  } else {
    m.absmax.resize(size_t((n + block - 1) / block));
    cpu::quantize_blocks(cpu::Isa::scalar, x.data(), n, block, is_signed, m.bytes.data(),
                         m.absmax.data());
  }
  return m;
}

// The f32 values the moments and the gradient are made from, for a test to change before
// they are stored.
struct CompactInputs {
  std::vector<float> m0, m1, grad;
};

// Several steps of the GPU update with moments in format f against the CPU's (scalar ISA; q8
// through optimizer_update_segments over the whole range, as the engine's q8 tasks do), each
// step reading what the last one wrote: master, moments, absmax and copy-out bitwise equal.
void check_compact(StateFormat f, const UpdateCase& c, int64_t n, int64_t block,
                   std::vector<cuda::UpdateRun> runs, uint32_t seed,
                   std::vector<cpu::UpdateHyper> hypers = {},
                   const std::function<void(CompactInputs&)>& edit = {}) {
  SCOPED_TRACE(std::string(state_format_name(f)) + " " + case_name(c) + " n=" + std::to_string(n) +
               " block=" + std::to_string(block) + " runs=" + std::to_string(runs.size()));
  std::mt19937 rng(seed);
  if (hypers.empty()) hypers = hypers_for(c);
  std::vector<float> master = uniform(rng, size_t(n), -2.0f, 2.0f);
  sprinkle(master, false);
  CompactInputs in;
  in.m0 = uniform(rng, size_t(n), -0.1f, 0.1f);
  in.m1 = uniform(rng, size_t(n), 0.0f, 0.01f);
  in.grad = uniform(rng, size_t(n), -3.0f, 3.0f);
  if (edit) edit(in);
  Moments m0 = narrow(f, in.m0, block, true);
  Moments m1 = narrow(f, in.m1, block, false);
  const auto grad = encode(c.grad, in.grad);
  const std::vector<float> dir = uniform(rng, size_t(n), -1.0f, 1.0f);  // Muon's direction
  const bool muon = c.kind == OptimizerKind::muon;
  const DType out_dt = c.has_out ? c.out : DType::f32;
  std::vector<unsigned char> out(size_t(n) * dtype_size(out_dt), 0xA5);
  std::sort(runs.begin(), runs.end(), [](auto& x, auto& y) { return x.begin < y.begin; });

  auto args = [&](void* pm, void* s0, void* s1, float* a0, float* a1, const void* g, void* o,
                  const float* d) {
    cpu::UpdateArgs a;
    a.master = pm;
    a.state0 = s0;
    a.state1 = s1;
    a.state_format = f;
    a.absmax0 = a0;
    a.absmax1 = a1;
    a.block = block;
    a.grad = g;
    a.grad_dtype = c.grad;
    a.out = c.has_out ? o : nullptr;
    a.out_dtype = out_dt;
    a.dir = muon ? d : nullptr;
    a.n = n;
    return a;
  };
  std::vector<float> rm = master;
  Moments r0 = m0, r1 = m1;
  std::vector<unsigned char> rout = out;
  DeviceBytes dm(master), d0(m0.bytes), d1(m1.bytes), dg(grad), dout(out), ddir(dir);
  DeviceBytes da0(m0.absmax.empty() ? std::vector<float>(1) : m0.absmax),
      da1(m1.absmax.empty() ? std::vector<float>(1) : m1.absmax);
  const bool q8 = f == StateFormat::q8;
  zeroshard::cuda::Stream stream(0);
  for (int step = 0; step < 3; ++step) {
    const cpu::UpdateArgs ra =
        args(rm.data(), r0.bytes.data(), r1.bytes.data(), q8 ? r0.absmax.data() : nullptr,
             q8 ? r1.absmax.data() : nullptr, grad.data(), rout.data(), dir.data());
    if (q8) {
      std::vector<cpu::UpdateSegment> segs;
      for (const auto& r : runs)
        if (r.begin < r.end) segs.push_back({r.begin, r.end, &hypers[size_t(r.hyper)]});
      cpu::optimizer_update_segments(cpu::Isa::scalar, segs.data(), int(segs.size()), ra);
    } else {
      for (const auto& r : runs) {
        cpu::UpdateArgs a = ra;
        a.master = rm.data() + r.begin;
        a.state0 = r0.bytes.data() + size_t(r.begin) * 2;
        a.state1 = r1.bytes.data() + size_t(r.begin) * 2;
        a.grad = grad.data() + size_t(r.begin) * dtype_size(c.grad);
        a.out = c.has_out ? rout.data() + size_t(r.begin) * dtype_size(out_dt) : nullptr;
        a.dir = muon ? dir.data() + r.begin : nullptr;
        a.n = r.end - r.begin;
        cpu::optimizer_update(cpu::Isa::scalar, hypers[size_t(r.hyper)], a);
      }
    }
    const cpu::UpdateArgs ga =
        args(dm.data(), d0.data(), d1.data(), q8 ? da0.as<float>() : nullptr,
             q8 ? da1.as<float>() : nullptr, dg.data(), dout.data(), ddir.as<float>());
    cuda::optimizer_update(hypers.data(), int(hypers.size()), runs.data(), int(runs.size()), ga,
                           stream.handle());
    stream.synchronize();
    SCOPED_TRACE("step " + std::to_string(step));
    const auto gm = dm.download<float>();
    EXPECT_EQ(first_mismatch(DType::f32, gm.data(), rm.data(), n), -1) << "master";
    EXPECT_TRUE(d0.download<unsigned char>() == r0.bytes) << "state0";
    EXPECT_TRUE(d1.download<unsigned char>() == r1.bytes) << "state1";
    if (q8) {
      EXPECT_EQ(first_mismatch(DType::f32, da0.download<float>().data(), r0.absmax.data(),
                               int64_t(r0.absmax.size())),
                -1)
          << "absmax0";
      EXPECT_EQ(first_mismatch(DType::f32, da1.download<float>().data(), r1.absmax.data(),
                               int64_t(r1.absmax.size())),
                -1)
          << "absmax1";
    }
    EXPECT_EQ(first_mismatch(out_dt, dout.download<unsigned char>().data(), rout.data(), n), -1)
        << "out";
  }
  // Not a no-op: the master and (where the rule keeps one) the first moment moved.
  EXPECT_NE(first_mismatch(DType::f32, rm.data(), master.data(), n), -1);
  if (c.kind != OptimizerKind::sgd || c.momentum != 0) {
    EXPECT_NE(r0.bytes, m0.bytes);
  }
}

TEST_F(GpuKernels, CompactMomentsMatchCpuWholeRange) {
  for (StateFormat f : {StateFormat::bf16, StateFormat::q8})
    for (int64_t block : {int64_t{256}, int64_t{2048}})
      for (int64_t n : {int64_t{7}, int64_t{256}, int64_t{4099}})
        for (const UpdateCase& c : all_cases()) {
          if (f == StateFormat::bf16 && block == 2048) continue;  // no blocks in bf16
          check_compact(f, c, n, block, {{0, n, 0}}, 21u + uint32_t(n));
        }
}

// Groups with unaligned ends inside one 8-bit block, a gap of a whole block that no run
// touches (left as it is, random state included), and the tail of the last block.
TEST_F(GpuKernels, CompactMomentsMatchCpuGroupRuns) {
  const std::vector<cuda::UpdateRun> runs = {
      {3, 700, 0}, {700, 703, 1}, {710, 713, 2}, {1300, 3001, 0}, {3001, 4995, 2}};
  for (StateFormat f : {StateFormat::bf16, StateFormat::q8})
    for (const UpdateCase& c : all_cases()) check_compact(f, c, 5000, 256, runs, 8u);
}

// More runs than one launch holds, in shuffled order: the 8-bit blocks split across launches
// with every run that touches a block in the block's launch.
TEST_F(GpuKernels, CompactMomentsMatchCpuManyRuns) {
  std::mt19937 rng(12);
  std::vector<cuda::UpdateRun> runs;
  int64_t pos = 0;
  for (int r = 0; r < 300; ++r) {
    const int64_t gap = int64_t(rng() % 3), len = 1 + int64_t(rng() % 60);
    runs.push_back({pos + gap, pos + gap + len, int(rng() % 3)});
    pos += gap + len;
  }
  std::shuffle(runs.begin(), runs.end(), rng);
  for (StateFormat f : {StateFormat::bf16, StateFormat::q8}) {
    check_compact(f, {OptimizerKind::adamw, 0, false, DType::bf16, true, DType::bf16}, pos, 2048,
                  runs, 13u);
    check_compact(f, {OptimizerKind::lion, 0, false, DType::f32, false, DType::f32}, pos, 256, runs,
                  14u);
  }
}

// SGD groups with and without momentum in one unit share its 8-bit blocks.
TEST_F(GpuKernels, EightBitMomentsMixedSgdRules) {
  const UpdateCase c{OptimizerKind::sgd, 0.9f, false, DType::bf16, true, DType::bf16};
  const std::vector<cuda::UpdateRun> runs = {{0, 1001, 0}, {1001, 2002, 1}, {2002, 3000, 2}};
  for (int plain : {0, 1}) {  // the plain group first, or in the middle
    std::vector<cpu::UpdateHyper> hypers = hypers_for(c);
    hypers[size_t(plain)].momentum = 0.0f;
    check_compact(StateFormat::q8, c, 3000, 256, runs, 15u, hypers);
  }
}

// A Muon engine's unit holds Muon and AdamW runs, some sharing an 8-bit block: the launch keeps
// both moments and each run takes its own rule, as on the CPU.
TEST_F(GpuKernels, CompactMomentsMuonBesideAdamW) {
  const UpdateCase c{OptimizerKind::muon, 0.95f, false, DType::bf16, true, DType::bf16};
  const std::vector<cuda::UpdateRun> runs = {{0, 1001, 0}, {1001, 2002, 1}, {2002, 3000, 2}};
  std::vector<cpu::UpdateHyper> hypers = hypers_for(c);
  hypers[1].kind = OptimizerKind::adamw;
  for (StateFormat f : {StateFormat::bf16, StateFormat::q8})
    check_compact(f, c, 3000, 256, runs, 16u, hypers);
}

// 8-bit blocks at the code's edges. Block 0 has no gradient and denormal first moments: its
// absmax decays below 2^-128, where 1 / absmax overflows and both sides divide by the absmax
// instead. Block 1 has an infinite gradient: its moments become inf, its absmax inf, and
// inf × 0 makes NaNs, whose sign x86 and CUDA make differently; both store NaN as the largest
// code without a sign. Codes and absmax bitwise as the CPU's.
TEST_F(GpuKernels, EightBitMomentsAtTheCodesEdges) {
  const UpdateCase c{OptimizerKind::adamw, 0, false, DType::f32, true, DType::bf16};
  check_compact(StateFormat::q8, c, 768, 256, {{0, 768, 0}}, 17u, {}, [](CompactInputs& in) {
    for (size_t i = 0; i < 256; ++i) {
      in.grad[i] = 0.0f;
      in.m0[i] = float(int(i % 3) - 1) * 1e-39f;
    }
    in.grad[300] = std::numeric_limits<float>::infinity();
  });
}

// ---- sum_squares_nonfinite ----------------------------------------------------------------------

struct SumResult {
  double sum, flag;
};

SumResult gpu_sum(const void* x, DType d, int64_t n, const double* init = nullptr) {
  DeviceBytes out(2 * sizeof(double)), ws(cuda::kSumSquaresWorkspaceBytes);
  if (init) out.upload(init, 2 * sizeof(double));
  cuda::sum_squares_nonfinite(x, d, n, out.as<double>(), init != nullptr, ws.data(), nullptr);
  const auto r = out.download<double>();
  return {r[0], r[1]};
}

TEST_F(GpuKernels, SumSquaresMatchesCpuAndIsReproducible) {
  std::mt19937 rng(21);
  for (DType d : kDTypes) {
    for (int64_t n : {int64_t{0}, int64_t{1}, int64_t{7}, int64_t{8}, int64_t{9}, int64_t{4099},
                      int64_t{(1 << 21) + 5}}) {
      SCOPED_TRACE(std::string(dtype_name(d)) + " n=" + std::to_string(n));
      std::vector<float> v = uniform(rng, size_t(n) + 1, -4.0f, 4.0f);
      sprinkle(v, false);
      // 65520 (sprinkled) rounds to inf in f16: keep every value finite in the stored dtype.
      if (d == DType::f16)
        for (float& x : v) x = std::clamp(x, -65504.0f, 65504.0f);
      const auto bytes = encode(d, v);
      // Exact-ish reference in long double from the values as stored in dtype d.
      long double exact = 0;
      for (int64_t i = 0; i < n; ++i) {
        float x;
        cpu::convert(cpu::Isa::scalar, bytes.data() + size_t(i) * dtype_size(d), d, &x, DType::f32,
                     1);
        exact += (long double)x * (long double)x;
      }
      const double cpu_sum = cpu::sum_squares(cpu::Isa::scalar, bytes.data(), d, n);
      DeviceBytes dev(bytes);
      const SumResult a = gpu_sum(dev.data(), d, n);
      const SumResult b = gpu_sum(dev.data(), d, n);
      EXPECT_EQ(a.flag, 0.0);
      const double tol = 1e-12 * std::max(1.0, double(exact));
      EXPECT_NEAR(a.sum, double(exact), tol);
      EXPECT_NEAR(a.sum, cpu_sum, 2 * tol);
      if (n > 0) {
        EXPECT_GT(a.sum, 0.0);
      }
      // Same bits every run, and the same from a pointer that is not 16-byte aligned.
      EXPECT_EQ(std::bit_cast<uint64_t>(a.sum), std::bit_cast<uint64_t>(b.sum));
      if (n > 0) {
        DeviceBytes shifted(bytes.size() + 16);
        char* p = static_cast<char*>(shifted.data()) + dtype_size(d);
        ZS_CUDA_CHECK(cudaMemcpy(p, bytes.data(), bytes.size(), cudaMemcpyHostToDevice));
        const SumResult c = gpu_sum(p, d, n);
        EXPECT_EQ(std::bit_cast<uint64_t>(a.sum), std::bit_cast<uint64_t>(c.sum))
            << "alignment changed the sum";
      }
    }
  }
}

TEST_F(GpuKernels, SumSquaresFlagsNonFinite) {
  for (DType d : kDTypes) {
    for (uint32_t bad : {0x7F800000u, 0xFF800000u, 0x7FC00000u}) {
      const int64_t n = 10007;
      std::vector<float> v(n, 0.5f);
      v[n - 3] = from_bits(bad);  // in the scalar tail of the last vector
      const auto bytes = encode(d, v);
      DeviceBytes dev(bytes);
      EXPECT_EQ(gpu_sum(dev.data(), d, n).flag, 1.0) << dtype_name(d) << " " << std::hex << bad;
      v[n - 3] = 0.5f;
      v[4096] = from_bits(bad);  // in a vector body
      const auto bytes2 = encode(d, v);
      DeviceBytes dev2(bytes2);
      EXPECT_EQ(gpu_sum(dev2.data(), d, n).flag, 1.0) << dtype_name(d) << " " << std::hex << bad;
    }
    // f16 overflow in the data itself (65520 rounds to inf when stored as f16).
    if (d == DType::f16) {
      const std::vector<float> v(100, 65520.0f);
      DeviceBytes dev(encode(d, v));
      EXPECT_EQ(gpu_sum(dev.data(), d, 100).flag, 1.0);
    }
  }
}

TEST_F(GpuKernels, SumSquaresAccumulates) {
  const std::vector<float> v(1000, 2.0f);  // Σ = 4000 exactly
  DeviceBytes dev(v);
  const double start[2] = {5.0, 0.0};
  SumResult r = gpu_sum(dev.data(), DType::f32, 1000, start);
  EXPECT_EQ(r.sum, 4005.0);
  EXPECT_EQ(r.flag, 0.0);
  const double flagged[2] = {1.0, 1.0};
  r = gpu_sum(dev.data(), DType::f32, 1000, flagged);
  EXPECT_EQ(r.sum, 4001.0);
  EXPECT_EQ(r.flag, 1.0) << "a flag set by an earlier unit must stay set";
}

// ---- convert and accumulate ---------------------------------------------------------------------

TEST_F(GpuKernels, ConvertMatchesCpu) {
  std::mt19937 rng(31);
  for (DType s : kDTypes) {
    for (DType d : kDTypes) {
      for (int64_t n : {int64_t{1}, int64_t{9}, int64_t{4099}, int64_t{100003}}) {
        for (size_t shift : {size_t{0}, size_t{1}}) {
          SCOPED_TRACE(std::string(dtype_name(s)) + "->" + dtype_name(d) +
                       " n=" + std::to_string(n) + " shift=" + std::to_string(shift));
          std::vector<float> v = uniform(rng, size_t(n), -70000.0f, 70000.0f);
          for (size_t i = 3; i < v.size(); i += 5) v[i] *= 1e-9f;  // small and subnormal f16 values
          sprinkle(v, true);
          const auto src = encode(s, v);
          std::vector<unsigned char> ref(size_t(n) * dtype_size(d), 0);
          cpu::convert(cpu::Isa::scalar, src.data(), s, ref.data(), d, n);
          // Shifted by one element: the element-wise (unaligned) path must agree too.
          DeviceBytes dsrc(src.size() + 16), ddst(ref.size() + 16);
          char* ps = static_cast<char*>(dsrc.data()) + shift * dtype_size(s);
          char* pd = static_cast<char*>(ddst.data()) + shift * dtype_size(d);
          ZS_CUDA_CHECK(cudaMemcpy(ps, src.data(), src.size(), cudaMemcpyHostToDevice));
          ZS_CUDA_CHECK(cudaMemset(ddst.data(), 0, ref.size() + 16));
          cuda::convert(ps, s, pd, d, n, nullptr);
          std::vector<unsigned char> got(ref.size());
          ZS_CUDA_CHECK(cudaMemcpy(got.data(), pd, got.size(), cudaMemcpyDeviceToHost));
          EXPECT_EQ(first_mismatch(d, got.data(), ref.data(), n), -1);
          EXPECT_NE(std::count(got.begin(), got.end(), 0), std::ptrdiff_t(got.size()))
              << "nothing written";
        }
      }
    }
  }
}

TEST_F(GpuKernels, AccumulateMatchesCpu) {
  std::mt19937 rng(41);
  for (DType d : kDTypes) {
    for (int64_t n : {int64_t{1}, int64_t{15}, int64_t{4099}, int64_t{100003}}) {
      for (size_t shift : {size_t{0}, size_t{1}}) {
        SCOPED_TRACE(std::string(dtype_name(d)) + " n=" + std::to_string(n) +
                     " shift=" + std::to_string(shift));
        std::vector<float> acc = uniform(rng, size_t(n), -1, 1);
        std::vector<float> g = uniform(rng, size_t(n), -1, 1);
        sprinkle(g, false);
        const auto gb = encode(d, g);
        std::vector<float> ref = acc;
        cpu::accumulate(cpu::Isa::scalar, ref.data(), gb.data(), d, n);
        DeviceBytes dacc(acc.size() * 4 + 16), dg(gb.size() + 16);
        float* pa = dacc.as<float>() + shift;
        char* pg = static_cast<char*>(dg.data()) + shift * dtype_size(d);
        ZS_CUDA_CHECK(cudaMemcpy(pa, acc.data(), acc.size() * 4, cudaMemcpyHostToDevice));
        ZS_CUDA_CHECK(cudaMemcpy(pg, gb.data(), gb.size(), cudaMemcpyHostToDevice));
        cuda::accumulate(pa, pg, d, n, nullptr);
        std::vector<float> got(acc.size());
        ZS_CUDA_CHECK(cudaMemcpy(got.data(), pa, got.size() * 4, cudaMemcpyDeviceToHost));
        EXPECT_EQ(first_mismatch(DType::f32, got.data(), ref.data(), n), -1);
        EXPECT_NE(first_mismatch(DType::f32, got.data(), acc.data(), n), -1)
            << "nothing accumulated";
      }
    }
  }
}

// ---- argument validation: runs before any CUDA call, so it needs no GPU -------------------------

TEST(GpuKernelArgs, UpdateRejectsBadRunsAndAlignment) {
  alignas(16) static float buf[64];
  cpu::UpdateHyper h;
  h.kind = OptimizerKind::adamw;
  cpu::UpdateArgs a;
  a.master = buf;
  a.state0 = buf;
  a.state1 = buf;
  a.grad = buf;
  a.n = 16;
  auto code_of = [&](std::vector<cuda::UpdateRun> runs, const cpu::UpdateArgs& args) {
    try {
      cuda::optimizer_update(&h, 1, runs.data(), int(runs.size()), args, nullptr);
    } catch (const Error& e) {
      return std::string(error_code_name(e.code())) + ": " + e.what();
    }
    return std::string("no error");
  };
  EXPECT_NE(code_of({{0, 17, 0}}, a).find("does not fit"), std::string::npos);
  EXPECT_NE(code_of({{0, 4, 1}}, a).find("does not fit"), std::string::npos);
  EXPECT_NE(code_of({{0, 8, 0}, {7, 9, 0}}, a).find("overlap"), std::string::npos);
  cpu::UpdateArgs mis = a;
  mis.master = buf + 1;
  EXPECT_NE(code_of({{0, 8, 0}}, mis).find("16-byte aligned"), std::string::npos);
  cpu::UpdateArgs no_state = a;
  no_state.state1 = nullptr;
  EXPECT_NE(code_of({{0, 8, 0}}, no_state).find("needs state0 and state1"), std::string::npos);
  // Nothing to do is not an error and launches nothing.
  EXPECT_EQ(code_of({{4, 4, 0}}, a), "no error");
  // 8-bit moments: their absmax arrays, a block size in range, at most 128 runs in one block
  // (the CPU takes any number; the GPU's run table lives in the kernel's parameters).
  cpu::UpdateArgs q8 = a;
  q8.state_format = StateFormat::q8;
  q8.block = 8;
  EXPECT_NE(code_of({{0, 8, 0}}, q8).find("absmax"), std::string::npos);
  q8.absmax0 = q8.absmax1 = buf;
  q8.block = 0;
  EXPECT_NE(code_of({{0, 8, 0}}, q8).find("q8 block of 0"), std::string::npos);
  alignas(16) static float big[4096];
  q8.master = q8.state0 = q8.state1 = big;
  q8.grad = big;
  q8.n = 4096;
  q8.block = 2048;
  std::vector<cuda::UpdateRun> crowded;
  for (int r = 0; r < 130; ++r) crowded.push_back({r * 8, r * 8 + 8, 0});
  EXPECT_NE(code_of(crowded, q8).find("more than 128 runs"), std::string::npos);
}

}  // namespace
}  // namespace zeroshard
