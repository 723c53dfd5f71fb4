// The fused optimizer update on the GPU: one pass reads master, state and gradient and writes
// master, state and the low-precision parameter copy, 8 elements per thread with 16-byte
// accesses. The arithmetic is cpu::optimizer_update's (kernels/cpu/update_impl.hpp) operation
// for operation: each multiply, add, divide and square root is an __f*_rn intrinsic, so nvcc
// cannot contract or reorder them and the results are bitwise equal to the CPU kernels.

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "kernels/cpu/update_rules.hpp"
#include "kernels/cuda/cuda_kernels.hpp"
#include "kernels/cuda/device_io.cuh"
#include "src/base/cuda_check.hpp"

namespace zeroshard::cuda {
namespace {

using dev::kVec;

// The rules, constants and dispatch of the CPU kernels (kernels/cpu/update_rules.hpp): the same
// definitions, so the GPU folds and selects exactly as the CPU reference does. Each
// (rule, grad dtype, copy-out) becomes its own kernel, with no per-element branch on them.
using cpu::fold_consts;
using cpu::Out;
using cpu::out_of;
using cpu::Rule;
using cpu::rule_of;
using cpu::with_dtype;
using cpu::with_out;
using cpu::with_rule;
using Consts = cpu::UpdateConsts;

constexpr int kThreads = 256;

// One run, split into an 8-aligned body [body_begin, body_end) done with vector accesses and a
// head [begin, body_begin) and tail [body_end, end) of at most 7 elements each, done per element
// by the run's first block. Blocks [first_block, next run's first_block) cover the body.
struct RunDesc {
  int64_t begin, body_begin, body_end, end;
  unsigned first_block;
  Consts c;
};

// Kernel parameters: pointers plus the run table, 32 × 80 bytes, inside the 4 KiB that every
// architecture accepts for kernel parameters.
struct UpdateParams {
  float* master;
  float* s0;
  float* s1;
  const void* grad;
  void* out;
  int num_runs;
  RunDesc runs[kMaxRunsPerLaunch];
};
static_assert(sizeof(UpdateParams) <= 4000, "kernel parameters must stay below 4 KiB");

template <Rule R>
constexpr bool kUsesS0 = R != Rule::sgd;
template <Rule R>
constexpr bool kUsesS1 = R == Rule::adam || R == Rule::adamw;

// sign(c) as ScalarVec::sign: ±1, +0 for ±0, NaN for NaN (c - c).
__device__ __forceinline__ float sign_of(float c) {
  return c > 0.0f ? 1.0f : (c < 0.0f ? -1.0f : __fsub_rn(c, c));
}

// The update of one element, in update_impl.hpp's order. C++ parses `a * b + c * d` as
// (a*b) + (c*d) and `a * b * c` as (a*b)*c; each step here is one rounded IEEE operation.
template <Rule R>
__device__ __forceinline__ void update_one(const Consts& k, float& p, float g_in, float& s0,
                                           float& s1) {
  float g = __fmul_rn(g_in, k.grad_scale);
  if constexpr (R == Rule::adam || R == Rule::adamw) {
    float m = s0, v = s1;
    if constexpr (R == Rule::adam) {
      g = __fadd_rn(g, __fmul_rn(k.wd, p));
    } else {
      p = __fsub_rn(p, __fmul_rn(k.lr_wd, p));
    }
    m = __fadd_rn(__fmul_rn(k.beta1, m), __fmul_rn(k.omb1, g));
    v = __fadd_rn(__fmul_rn(k.beta2, v), __fmul_rn(__fmul_rn(k.omb2, g), g));
    const float denom = __fadd_rn(__fsqrt_rn(__fdiv_rn(v, k.bc2)), k.eps);
    p = __fsub_rn(p, __fdiv_rn(__fmul_rn(k.lr, __fdiv_rn(m, k.bc1)), denom));
    s0 = m;
    s1 = v;
  } else if constexpr (R == Rule::lion) {
    const float m = s0;
    const float dir = __fadd_rn(__fmul_rn(k.beta1, m), __fmul_rn(k.omb1, g));
    p = __fsub_rn(p, __fmul_rn(k.lr_wd, p));
    p = __fsub_rn(p, __fmul_rn(k.lr, sign_of(dir)));
    s0 = __fadd_rn(__fmul_rn(k.beta2, m), __fmul_rn(k.omb2, g));
  } else {
    g = __fadd_rn(g, __fmul_rn(k.wd, p));
    if constexpr (R == Rule::sgd_momentum || R == Rule::sgd_nesterov) {
      const float buf = __fadd_rn(__fmul_rn(k.momentum, s0), g);
      s0 = buf;
      if constexpr (R == Rule::sgd_nesterov) {
        g = __fadd_rn(g, __fmul_rn(k.momentum, buf));
      } else {
        g = buf;
      }
    }
    p = __fsub_rn(p, __fmul_rn(k.lr, g));
  }
}

template <Out O>
constexpr DType kOutDType = O == Out::bf16  ? DType::bf16
                            : O == Out::f16 ? DType::f16
                                            : DType::f32;

// One element e (head or tail of a run): the same update with scalar accesses.
template <Rule R, DType G, Out O>
__device__ __forceinline__ void update_element(const UpdateParams& P, const Consts& k, int64_t e) {
  float p = P.master[e];
  float s0 = 0.0f, s1 = 0.0f;
  if constexpr (kUsesS0<R>) s0 = P.s0[e];
  if constexpr (kUsesS1<R>) s1 = P.s1[e];
  update_one<R>(k, p, dev::load1<G>(P.grad, e), s0, s1);
  P.master[e] = p;
  if constexpr (kUsesS0<R>) P.s0[e] = s0;
  if constexpr (kUsesS1<R>) P.s1[e] = s1;
  if constexpr (O != Out::none) dev::store1<kOutDType<O>>(P.out, e, p);
}

// __grid_constant__ keeps the run table in the parameter bank (indexed in place, no local copy).
template <Rule R, DType G, Out O>
__global__ void __launch_bounds__(kThreads) update_kernel(const __grid_constant__ UpdateParams P) {
  // The block's run: the last one whose first block is at or before this block (few runs, and
  // the scan is uniform across the block, so it costs a handful of constant-bank reads).
  int r = 0;
  while (r + 1 < P.num_runs && P.runs[r + 1].first_block <= blockIdx.x) ++r;
  const RunDesc& run = P.runs[r];
  const Consts k = run.c;

  const int64_t i =
      run.body_begin + (int64_t(blockIdx.x - run.first_block) * kThreads + threadIdx.x) * kVec;
  if (i < run.body_end) {
    float p[kVec], g[kVec], s0[kVec] = {}, s1[kVec] = {};
    dev::load8f(P.master, i, p);
    dev::load8<G>(P.grad, i, g);
    if constexpr (kUsesS0<R>) dev::load8f(P.s0, i, s0);
    if constexpr (kUsesS1<R>) dev::load8f(P.s1, i, s1);
#pragma unroll
    for (int j = 0; j < kVec; ++j) update_one<R>(k, p[j], g[j], s0[j], s1[j]);
    dev::store8f(P.master, i, p);
    if constexpr (kUsesS0<R>) dev::store8f(P.s0, i, s0);
    if constexpr (kUsesS1<R>) dev::store8f(P.s1, i, s1);
    if constexpr (O != Out::none) dev::store8<kOutDType<O>>(P.out, i, p);
  }
  // Head (threads 0-7) and tail (threads 8-15) of the run, by its first block.
  if (blockIdx.x == run.first_block && threadIdx.x < 2 * kVec) {
    const int t = int(threadIdx.x);
    const int64_t e = t < kVec ? run.begin + t : run.body_end + (t - kVec);
    const int64_t stop = t < kVec ? run.body_begin : run.end;
    if (e < stop) update_element<R, G, O>(P, k, e);
  }
}

const char* rule_name(Rule r) {
  switch (r) {
    case Rule::adam:
      return "adam";
    case Rule::adamw:
      return "adamw";
    case Rule::sgd:
      return "sgd";
    case Rule::sgd_momentum:
      return "sgd (momentum)";
    case Rule::sgd_nesterov:
      return "sgd (nesterov)";
    case Rule::lion:
      return "lion";
  }
  return "?";
}

// float4 / uint4 accesses fault on misaligned addresses, so alignment is checked up front.
bool aligned16(const void* p) {
  return reinterpret_cast<uintptr_t>(p) % 16 == 0;
}

// The non-empty runs in begin order, once the arguments are checked: counts, runs in range and
// disjoint, hyperparameter indices valid, pointers aligned for the vector accesses.
std::vector<UpdateRun> checked_runs(const cpu::UpdateHyper* hypers, int num_hypers,
                                    const UpdateRun* runs, int num_runs, const cpu::UpdateArgs& a) {
  if (num_runs < 0 || num_hypers < 0 || a.n < 0 || (num_runs > 0 && (!runs || !hypers)))
    ZS_THROW(invalid_argument, "cuda::optimizer_update: bad counts ("
                                   << num_runs << " runs, " << num_hypers
                                   << " hyperparameter sets, n = " << a.n << ")");
  // Runs are checked in begin order: in range, non-empty ones disjoint, hyper index valid.
  std::vector<UpdateRun> sorted;
  for (int r = 0; r < num_runs; ++r) {
    const UpdateRun& u = runs[r];
    if (u.begin < 0 || u.begin > u.end || u.end > a.n || u.hyper < 0 || u.hyper >= num_hypers)
      ZS_THROW(invalid_argument, "cuda::optimizer_update: run "
                                     << r << " [" << u.begin << ", " << u.end
                                     << ") with hyperparameters " << u.hyper << " does not fit n = "
                                     << a.n << " and " << num_hypers << " hyperparameter sets");
    if (u.begin < u.end) sorted.push_back(u);
  }
  // Nothing to update launches nothing (and touches no CUDA API).
  if (sorted.empty()) return sorted;
  std::sort(sorted.begin(), sorted.end(),
            [](const UpdateRun& x, const UpdateRun& y) { return x.begin < y.begin; });
  for (size_t r = 1; r < sorted.size(); ++r) {
    if (sorted[r].begin < sorted[r - 1].end)
      ZS_THROW(invalid_argument, "cuda::optimizer_update: runs ["
                                     << sorted[r - 1].begin << ", " << sorted[r - 1].end
                                     << ") and [" << sorted[r].begin << ", " << sorted[r].end
                                     << ") overlap");
  }
  for (const void* p :
       {static_cast<const void*>(a.master), static_cast<const void*>(a.state0),
        static_cast<const void*>(a.state1), a.grad, static_cast<const void*>(a.out)}) {
    if (!aligned16(p))
      ZS_THROW(invalid_argument, "cuda::optimizer_update: pointer "
                                     << p
                                     << " is not 16-byte aligned (the kernel moves 8 elements per "
                                        "vector access)");
  }
  if (!a.master || !a.grad)
    ZS_THROW(invalid_argument, "cuda::optimizer_update: master and grad must not be null");
  return sorted;
}

}  // namespace

void optimizer_update(const cpu::UpdateHyper* hypers, int num_hypers, const UpdateRun* runs,
                      int num_runs, const cpu::UpdateArgs& a, StreamHandle stream) {
  const std::vector<UpdateRun> sorted = checked_runs(hypers, num_hypers, runs, num_runs, a);
  if (sorted.empty()) return;
  // Group the runs by update rule (in practice there is one), then launch each group in batches
  // of at most kMaxRunsPerLaunch runs.
  std::vector<std::pair<Rule, std::vector<UpdateRun>>> by_rule;
  for (const UpdateRun& u : sorted) {
    const Rule rule = rule_of(hypers[u.hyper]);
    auto it =
        std::find_if(by_rule.begin(), by_rule.end(), [&](auto& e) { return e.first == rule; });
    if (it == by_rule.end()) {
      by_rule.push_back({rule, {}});
      it = by_rule.end() - 1;
    }
    it->second.push_back(u);
  }
  // Every launch takes the same pointers; only the run table and the rule differ.
  const Out out = out_of(a);
  auto cu_stream = static_cast<cudaStream_t>(stream);
  // The GPU kernels keep f32 moments; Config::validate() refuses the others on a GPU tier.
  if (a.state_format != StateFormat::f32)
    ZS_THROW(invalid_argument, "cuda::optimizer_update: moments stored as "
                                   << state_format_name(a.state_format)
                                   << " are not supported on the GPU (f32 only)");
  if (a.master_dtype != DType::f32)
    ZS_THROW(invalid_argument, "cuda::optimizer_update: a " << dtype_name(a.master_dtype)
                                                            << " master is not supported on the "
                                                               "GPU (f32 only)");
  for (auto& [rule, list] : by_rule) {
    const bool needs_s0 = rule != Rule::sgd;
    const bool needs_s1 = rule == Rule::adam || rule == Rule::adamw;
    if ((needs_s0 && !a.state0) || (needs_s1 && !a.state1))
      ZS_THROW(invalid_argument, "cuda::optimizer_update: " << rule_name(rule) << " needs state0"
                                                            << (needs_s1 ? " and state1" : "")
                                                            << ", got null");
    for (size_t first = 0; first < list.size(); first += kMaxRunsPerLaunch) {
      UpdateParams P{};
      P.master = static_cast<float*>(a.master);
      P.s0 = static_cast<float*>(a.state0);
      P.s1 = static_cast<float*>(a.state1);
      P.grad = a.grad;
      P.out = a.out;
      P.num_runs = int(std::min<size_t>(kMaxRunsPerLaunch, list.size() - first));
      uint64_t blocks = 0;
      for (int r = 0; r < P.num_runs; ++r) {
        const UpdateRun& u = list[first + size_t(r)];
        RunDesc& d = P.runs[r];
        d.begin = u.begin;
        d.end = u.end;
        d.body_begin = std::min(u.end, (u.begin + kVec - 1) / kVec * kVec);
        d.body_end = std::max(d.body_begin, u.end / kVec * kVec);
        d.first_block = unsigned(blocks);
        d.c = fold_consts(hypers[u.hyper]);
        const int64_t vecs = (d.body_end - d.body_begin) / kVec;
        // At least one block per run: its first block also does the head and the tail.
        blocks += uint64_t(std::max<int64_t>(1, (vecs + kThreads - 1) / kThreads));
      }
      if (blocks > 0x7FFFFFFFull)
        ZS_THROW(invalid_argument,
                 "cuda::optimizer_update: " << a.n << " elements need more than 2^31 blocks");
      with_rule(rule, [&](auto R) {
        with_dtype(a.grad_dtype, [&](auto G) {
          with_out(out, [&](auto O) {
            update_kernel<decltype(R)::value, decltype(G)::value, decltype(O)::value>
                <<<unsigned(blocks), kThreads, 0, cu_stream>>>(P);
          });
        });
      });
      ZS_CUDA_CHECK_LAUNCH("cuda::optimizer_update (" << rule_name(rule) << ", grad "
                                                      << dtype_name(a.grad_dtype) << ")");
    }
  }
}

}  // namespace zeroshard::cuda
