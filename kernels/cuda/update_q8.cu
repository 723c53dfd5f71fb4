// The fused optimizer update with 8-bit moments on the GPU, as the CPU's update_q8
// (kernels/cpu/update_impl.hpp) does it: one thread block per quantization block (at most
// cpu::kMaxStateBlock elements, 16 per thread), which dequantizes both moments into registers
// (point × absmax), updates the elements its runs cover (update_one.cuh), takes the block's new
// absmax (max |x|, NaN ignored) and writes the nearest code of x × (1 / absmax) with the CPU's
// own functions (cpu::Q8Code, kernels/cpu/quant_code.hpp). A block that
// no run touches is left as it is; a block some run touches is requantized whole, the elements
// outside every run included, as on the CPU.

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "base/cuda_check.hpp"
#include "kernels/cpu/quant_code.hpp"
#include "kernels/cuda/device_io.cuh"
#include "kernels/cuda/update_one.cuh"

namespace zeroshard::cuda::detail {
namespace {

constexpr int kPerThread = int(cpu::kMaxStateBlock) / kThreads;
static_assert(cpu::kMaxStateBlock % kThreads == 0);

// Runs relative to nothing (element indices of the unit), each naming one of the launch's
// hyperparameter sets; all of one rule. 128 runs and 16 sets keep the parameters below 4 KiB.
constexpr int kMaxRuns = 128;
constexpr int kMaxSets = 16;

struct Q8Params {
  float* master;
  uint8_t* q0;
  uint8_t* q1;
  float* absmax0;
  float* absmax1;
  const void* grad;
  const float* dir;  // Muon's direction, like grad (the muon rule only)
  void* out;
  int64_t n, block, first_block;
  int num_runs;
  int64_t run_begin[kMaxRuns], run_end[kMaxRuns];
  uint8_t run_set[kMaxRuns];
  Consts sets[kMaxSets];
  Rule set_rule[kMaxSets];  // each set's own rule (update_with())
};
static_assert(sizeof(Q8Params) <= 4000, "kernel parameters must stay below 4 KiB");

// max(x, y) for values that are never NaN (the accumulators below skip NaN).
__device__ __forceinline__ float max_of(float x, float y) {
  return y > x ? y : x;
}

// The block's maximum of every thread's `x`; every thread gets it. `warps` holds one float per
// warp.
__device__ __forceinline__ float block_max(float x, float* warps) {
  for (int d = 16; d > 0; d /= 2) x = max_of(x, __shfl_xor_sync(0xFFFFFFFFu, x, d));
  const int lane = int(threadIdx.x) % 32, warp = int(threadIdx.x) / 32;
  if (lane == 0) warps[warp] = x;
  __syncthreads();
  x = warps[0];
  for (int w = 1; w < kThreads / 32; ++w) x = max_of(x, warps[w]);
  __syncthreads();  // `warps` is reused by the next call
  return x;
}

// The block's new absmax and its codes: as cpu::quantize_block (all-zero or all-NaN blocks get
// the code of 0 and absmax 0).
template <bool Signed>
__device__ __forceinline__ void requantize(const float (&x)[kPerThread], int64_t b, int64_t len,
                                           uint8_t* q, float* absmax, int64_t blk, float* warps) {
  float acc = 0.0f;
#pragma unroll
  for (int k = 0; k < kPerThread; ++k) {
    const int64_t j = int64_t(threadIdx.x) + int64_t(k) * kThreads;
    // a > acc ? a : acc, as the CPU's max(|x|, acc): a NaN never replaces acc.
    if (j < len) acc = fabsf(x[k]) > acc ? fabsf(x[k]) : acc;
  }
  const float amax = block_max(acc, warps);
  const bool zero = !(amax > 0.0f);
  const float inv = zero ? 0.0f : __fdiv_rn(1.0f, amax);
  const bool tiny = !(inv <= 3.402823466e38f);  // as cpu::quantize_block: divide instead
#pragma unroll
  for (int k = 0; k < kPerThread; ++k) {
    const int64_t j = int64_t(threadIdx.x) + int64_t(k) * kThreads;
    if (j < len)
      q[b + j] = zero ? cpu::kQ8Zero
                      : cpu::Q8Code<Signed>::encode(
                            __float_as_uint(tiny ? __fdiv_rn(x[k], amax) : __fmul_rn(x[k], inv)));
  }
  if (threadIdx.x == 0) absmax[blk] = zero ? 0.0f : amax;
}

// One element by its set's own rule. R names the moments the launch dequantizes and
// requantizes: those of every rule in it, as the CPU's update_q8 keeps them (SGD groups with and
// without momentum may share a unit, and a Muon engine's AdamW groups a Muon unit).
template <Rule R>
__device__ __forceinline__ void update_with(Rule rule, const Consts& k, float& p, float g, float d,
                                            float& s0, float& s1) {
  switch (rule) {
    case Rule::adam:
      if constexpr (kUsesS1<R>) update_one<Rule::adam>(k, p, g, d, s0, s1);
      break;
    case Rule::adamw:
      if constexpr (kUsesS1<R>) update_one<Rule::adamw>(k, p, g, d, s0, s1);
      break;
    case Rule::muon:
      if constexpr (kUsesS0<R>) update_one<Rule::muon>(k, p, g, d, s0, s1);
      break;
    case Rule::lion:
      if constexpr (kUsesS0<R>) update_one<Rule::lion>(k, p, g, d, s0, s1);
      break;
    case Rule::sgd_momentum:
      if constexpr (kUsesS0<R>) update_one<Rule::sgd_momentum>(k, p, g, d, s0, s1);
      break;
    case Rule::sgd_nesterov:
      if constexpr (kUsesS0<R>) update_one<Rule::sgd_nesterov>(k, p, g, d, s0, s1);
      break;
    case Rule::sgd:
      update_one<Rule::sgd>(k, p, g, d, s0, s1);
      break;
  }
}

template <Rule R, DType G, Out O>
__global__ void __launch_bounds__(kThreads) update_q8_kernel(const __grid_constant__ Q8Params P) {
  __shared__ float warps[kThreads / 32];
  const int64_t blk = P.first_block + int64_t(blockIdx.x);
  const int64_t b = blk * P.block;
  const int64_t len = min(P.block, P.n - b);
  // The first run that ends past the block's start; none inside: the block stays as it is.
  // The same for every thread, so the whole block returns or none of it.
  int first = 0;
  while (first < P.num_runs && P.run_end[first] <= b) ++first;
  if (first == P.num_runs || P.run_begin[first] >= b + len) return;

  const float a0 = kUsesS0<R> ? P.absmax0[blk] : 0.0f;
  const float a1 = kUsesS1<R> ? P.absmax1[blk] : 0.0f;
  float m[kPerThread], v[kPerThread];
  int r = first;
#pragma unroll
  for (int k = 0; k < kPerThread; ++k) {
    m[k] = 0.0f;
    v[k] = 0.0f;
    const int64_t j = int64_t(threadIdx.x) + int64_t(k) * kThreads;
    if (j >= len) continue;
    const int64_t e = b + j;
    if constexpr (kUsesS0<R>)
      m[k] = __fmul_rn(__uint_as_float(cpu::Q8Code<true>::point_bits(P.q0[e])), a0);
    if constexpr (kUsesS1<R>)
      v[k] = __fmul_rn(__uint_as_float(cpu::Q8Code<false>::point_bits(P.q1[e])), a1);
    while (r < P.num_runs && P.run_end[r] <= e) ++r;
    if (r == P.num_runs || P.run_begin[r] > e) continue;  // in no run: kept as dequantized
    float p = P.master[e];
    const int set = P.run_set[r];
    const float d = P.set_rule[set] == Rule::muon ? P.dir[e] : 0.0f;  // the set's rule, not R
    update_with<R>(P.set_rule[set], P.sets[set], p, dev::load1<G>(P.grad, e), d, m[k], v[k]);
    P.master[e] = p;
    if constexpr (O != Out::none) dev::store1<kOutDType<O>>(P.out, e, p);
  }
  if constexpr (kUsesS0<R>) requantize<true>(m, b, len, P.q0, P.absmax0, blk, warps);
  if constexpr (kUsesS1<R>) requantize<false>(v, b, len, P.q1, P.absmax1, blk, warps);
}

}  // namespace

void update_q8(const cpu::UpdateHyper* hypers, int num_hypers, const std::vector<UpdateRun>& runs,
               const cpu::UpdateArgs& a, cudaStream_t stream) {
  const int64_t block = a.block;
  if (block < 1 || block > cpu::kMaxStateBlock)
    ZS_THROW(invalid_argument, "cuda::optimizer_update: q8 block of "
                                   << block << " elements (1.." << cpu::kMaxStateBlock << ")");
  // The rule whose moments the launch keeps: both where any run is Adam's, else the first
  // moment where any run keeps one (update_with() then runs each set's own rule).
  Rule rule = Rule::sgd;
  for (const UpdateRun& u : runs) {
    const Rule r = rule_of(hypers[u.hyper]);
    if (r == Rule::adam || r == Rule::adamw)
      rule = r;
    else if (r != Rule::sgd && rule == Rule::sgd)
      rule = r;
  }
  const bool needs_s1 = rule == Rule::adam || rule == Rule::adamw;
  if ((rule != Rule::sgd && !a.absmax0) || (needs_s1 && !a.absmax1))
    ZS_THROW(invalid_argument, "cuda::optimizer_update: q8 moments need their absmax arrays");
  // Launches over consecutive blocks, each with at most kMaxRuns runs and kMaxSets sets; a
  // launch ends before the block where the first run it cannot take begins.
  const int64_t blocks_total = (a.n + block - 1) / block;
  size_t r = 0;
  int64_t blk = runs[0].begin / block;
  while (r < runs.size()) {
    blk = std::max(blk, runs[r].begin / block);
    Q8Params P{};
    P.master = static_cast<float*>(a.master);
    P.q0 = static_cast<uint8_t*>(a.state0);
    P.q1 = static_cast<uint8_t*>(a.state1);
    P.absmax0 = a.absmax0;
    P.absmax1 = a.absmax1;
    P.grad = a.grad;
    P.dir = a.dir;
    P.out = a.out;
    P.n = a.n;
    P.block = block;
    P.first_block = blk;
    std::vector<int> set_of(size_t(num_hypers), -1);
    int sets = 0;
    size_t end = r;
    for (; end < runs.size() && P.num_runs < kMaxRuns; ++end) {
      int& s = set_of[size_t(runs[end].hyper)];
      if (s < 0) {
        if (sets == kMaxSets) break;
        s = sets++;
        P.sets[s] = fold_consts(hypers[runs[end].hyper]);
        P.set_rule[s] = rule_of(hypers[runs[end].hyper]);
      }
      P.run_begin[P.num_runs] = runs[end].begin;
      P.run_end[P.num_runs] = runs[end].end;
      P.run_set[P.num_runs] = uint8_t(s);
      ++P.num_runs;
    }
    const int64_t blk_end =
        end == runs.size() ? (runs.back().end + block - 1) / block : runs[end].begin / block;
    if (blk_end <= blk)
      ZS_THROW(invalid_argument,
               "cuda::optimizer_update: the q8 block at element "
                   << blk * block << " holds more than " << kMaxRuns << " runs or " << kMaxSets
                   << " parameter groups; use fewer groups or f32 or bf16 moments");
    if (blk_end - blk > 0x7FFFFFFF || blk_end > blocks_total)
      ZS_THROW(invalid_argument, "cuda::optimizer_update: " << a.n << " elements in blocks of "
                                                            << block << " do not fit a launch");
    with_rule(rule, [&](auto R) {
      with_dtype(a.grad_dtype, [&](auto G) {
        with_out(out_of(a), [&](auto O) {
          update_q8_kernel<decltype(R)::value, decltype(G)::value, decltype(O)::value>
              <<<unsigned(blk_end - blk), kThreads, 0, stream>>>(P);
        });
      });
    });
    ZS_CUDA_CHECK_LAUNCH("cuda::optimizer_update (" << rule_name(rule) << ", grad "
                                                    << dtype_name(a.grad_dtype)
                                                    << ", 8-bit moments)");
    // The next launch starts at blk_end, with the first run still reaching into it.
    blk = blk_end;
    r = end;
    while (r > 0 && runs[r - 1].end > blk * block) --r;
  }
}

}  // namespace zeroshard::cuda::detail
