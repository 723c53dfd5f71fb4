// The fused optimizer update on the GPU: one pass reads master, state and gradient and writes
// master, state and the low-precision parameter copy, 8 elements per thread with 16-byte
// accesses. Moments in f32 or bf16 (rounded to nearest even, as the CPU stores them); 8-bit
// moments go to update_q8.cu. The per-element arithmetic is update_one.cuh's.

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "base/cuda_check.hpp"
#include "kernels/cuda/cuda_kernels.hpp"
#include "kernels/cuda/device_io.cuh"
#include "kernels/cuda/launch_math.hpp"
#include "kernels/cuda/update_one.cuh"

namespace zeroshard::cuda {
namespace {

using namespace detail;
using dev::kVec;
static_assert(kThreads == launch::kThreads && kVec == launch::kVec);

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
  void* s0;  // moments as S (f32 or bf16)
  void* s1;
  const void* grad;
  const float* dir;  // Muon's direction, like grad (the muon rule only)
  void* out;
  int num_runs;
  RunDesc runs[kMaxRunsPerLaunch];
};
static_assert(sizeof(UpdateParams) <= 4000, "kernel parameters must stay below 4 KiB");

// One element e (head or tail of a run): the same update with scalar accesses.
template <Rule R, DType G, Out O, DType S>
__device__ __forceinline__ void update_element(const UpdateParams& P, const Consts& k, int64_t e) {
  float p = P.master[e];
  float s0 = 0.0f, s1 = 0.0f;
  if constexpr (kUsesS0<R>) s0 = dev::load1<S>(P.s0, e);
  if constexpr (kUsesS1<R>) s1 = dev::load1<S>(P.s1, e);
  const float d = kUsesDir<R> ? P.dir[e] : 0.0f;
  update_one<R>(k, p, dev::load1<G>(P.grad, e), d, s0, s1);
  P.master[e] = p;
  if constexpr (kUsesS0<R>) dev::store1<S>(P.s0, e, s0);
  if constexpr (kUsesS1<R>) dev::store1<S>(P.s1, e, s1);
  if constexpr (O != Out::none) dev::store1<kOutDType<O>>(P.out, e, p);
}

// __grid_constant__ keeps the run table in the parameter bank (indexed in place, no local copy).
template <Rule R, DType G, Out O, DType S>
__global__ void __launch_bounds__(kThreads) update_kernel(const __grid_constant__ UpdateParams P) {
  // The block's run: the last one whose first block is at or before this block (few runs, and
  // the scan is uniform across the block, so it costs a handful of constant-bank reads).
  int r = 0;
  while (r + 1 < P.num_runs && P.runs[r + 1].first_block <= blockIdx.x) ++r;
  const RunDesc& run = P.runs[r];
  const Consts k = run.c;

  const launch::RunSplit split{run.body_begin, run.body_end};
  const int64_t i = launch::body_element(split, blockIdx.x - run.first_block, threadIdx.x);
  if (i < run.body_end) {
    float p[kVec], g[kVec], d[kVec] = {}, s0[kVec] = {}, s1[kVec] = {};
    dev::load8f(P.master, i, p);
    if constexpr (kUsesDir<R>) dev::load8f(P.dir, i, d);
    dev::load8<G>(P.grad, i, g);
    if constexpr (kUsesS0<R>) dev::load8<S>(P.s0, i, s0);
    if constexpr (kUsesS1<R>) dev::load8<S>(P.s1, i, s1);
#pragma unroll
    for (int j = 0; j < kVec; ++j) update_one<R>(k, p[j], g[j], d[j], s0[j], s1[j]);
    dev::store8f(P.master, i, p);
    if constexpr (kUsesS0<R>) dev::store8<S>(P.s0, i, s0);
    if constexpr (kUsesS1<R>) dev::store8<S>(P.s1, i, s1);
    if constexpr (O != Out::none) dev::store8<kOutDType<O>>(P.out, i, p);
  }
  // Head (threads 0-7) and tail (threads 8-15) of the run, by its first block.
  if (blockIdx.x == run.first_block && threadIdx.x < 2 * kVec) {
    const int t = int(threadIdx.x);
    const int64_t e = launch::head_tail_element(run.begin, split, t);
    const int64_t stop = launch::head_tail_stop(run.end, split, t);
    if (e < stop) update_element<R, G, O, S>(P, k, e);
  }
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
  for (const void* p : {static_cast<const void*>(a.master), static_cast<const void*>(a.state0),
                        static_cast<const void*>(a.state1), a.grad, static_cast<const void*>(a.out),
                        static_cast<const void*>(a.dir)}) {
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
  // A bf16 master rounds stochastically on the CPU; Config::validate() keeps it off the GPU.
  if (a.master_dtype != DType::f32)
    ZS_THROW(invalid_argument, "cuda::optimizer_update: a " << dtype_name(a.master_dtype)
                                                            << " master is not supported on the "
                                                               "GPU (f32 only)");
  const StateFormat f = a.state_format;
  if (f != StateFormat::f32 && f != StateFormat::bf16 && f != StateFormat::q8)
    ZS_THROW(invalid_argument,
             "cuda::optimizer_update: invalid state format " << static_cast<int>(f));
  for (const UpdateRun& u : sorted) {
    const Rule rule = rule_of(hypers[u.hyper]);
    if (rule == Rule::muon && !a.dir)
      ZS_THROW(invalid_argument,
               "cuda::optimizer_update: muon needs its direction (UpdateArgs::dir), got null");
    const bool needs_s1 = rule == Rule::adam || rule == Rule::adamw;
    if ((rule != Rule::sgd && !a.state0) || (needs_s1 && !a.state1))
      ZS_THROW(invalid_argument, "cuda::optimizer_update: " << rule_name(rule) << " needs state0"
                                                            << (needs_s1 ? " and state1" : "")
                                                            << ", got null");
  }
  auto cu_stream = static_cast<cudaStream_t>(stream);
  if (f == StateFormat::q8) {
    update_q8(hypers, num_hypers, sorted, a, cu_stream);
    return;
  }
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
  const bool bf16_state = f == StateFormat::bf16;
  for (auto& [rule, list] : by_rule) {
    for (size_t first = 0; first < list.size(); first += kMaxRunsPerLaunch) {
      UpdateParams P{};
      P.master = static_cast<float*>(a.master);
      P.s0 = a.state0;
      P.s1 = a.state1;
      P.grad = a.grad;
      P.dir = a.dir;
      P.out = a.out;
      P.num_runs = int(std::min<size_t>(kMaxRunsPerLaunch, list.size() - first));
      uint64_t blocks = 0;
      for (int r = 0; r < P.num_runs; ++r) {
        const UpdateRun& u = list[first + size_t(r)];
        RunDesc& d = P.runs[r];
        d.begin = u.begin;
        d.end = u.end;
        const launch::RunSplit split = launch::split_run(u.begin, u.end);
        d.body_begin = split.body_begin;
        d.body_end = split.body_end;
        d.first_block = unsigned(blocks);
        d.c = fold_consts(hypers[u.hyper]);
        // At least one block per run: its first block also does the head and the tail.
        blocks += uint64_t(launch::run_blocks(split));
      }
      if (blocks > uint64_t(launch::kMaxBlocks))
        ZS_THROW(invalid_argument,
                 "cuda::optimizer_update: " << a.n << " elements need more than 2^31 blocks");
      with_rule(rule, [&](auto R) {
        with_dtype(a.grad_dtype, [&](auto G) {
          with_out(out, [&](auto O) {
            constexpr Rule kR = decltype(R)::value;
            constexpr DType kG = decltype(G)::value;
            constexpr Out kO = decltype(O)::value;
            if (bf16_state)
              update_kernel<kR, kG, kO, DType::bf16>
                  <<<unsigned(blocks), kThreads, 0, cu_stream>>>(P);
            else
              update_kernel<kR, kG, kO, DType::f32>
                  <<<unsigned(blocks), kThreads, 0, cu_stream>>>(P);
          });
        });
      });
      ZS_CUDA_CHECK_LAUNCH("cuda::optimizer_update (" << rule_name(rule) << ", grad "
                                                      << dtype_name(a.grad_dtype) << ", moments "
                                                      << state_format_name(f) << ")");
    }
  }
}

}  // namespace zeroshard::cuda
