#pragma once
// The per-element optimizer update shared by the GPU kernels (update.cu: f32 and bf16 moments;
// update_q8.cu: 8-bit moments). The arithmetic is cpu::optimizer_update's
// (kernels/cpu/update_impl.hpp) operation for operation: each multiply, add, divide and square
// root is an __f*_rn intrinsic, so nvcc cannot contract or reorder them and the results are
// bitwise equal to the CPU kernels.

#include <cuda_runtime.h>

#include <vector>

#include "base/check.hpp"
#include "kernels/cpu/update_rules.hpp"
#include "kernels/cuda/cuda_kernels.hpp"

namespace zeroshard::cuda::detail {

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

inline constexpr int kThreads = 256;

template <Rule R>
inline constexpr bool kUsesS0 = R != Rule::sgd;
template <Rule R>
inline constexpr bool kUsesS1 = R == Rule::adam || R == Rule::adamw;
template <Rule R>
inline constexpr bool kUsesDir = R == Rule::muon;  // UpdateArgs::dir, Muon's direction

// sign(c) as ScalarVec::sign: ±1, +0 for ±0, NaN for NaN (c - c).
__device__ __forceinline__ float sign_of(float c) {
  return c > 0.0f ? 1.0f : (c < 0.0f ? -1.0f : __fsub_rn(c, c));
}

// The update of one element, in update_impl.hpp's order. C++ parses `a * b + c * d` as
// (a*b) + (c*d) and `a * b * c` as (a*b)*c; each step here is one rounded IEEE operation.
// `d` is the element's Muon direction (read by the muon rule only).
template <Rule R>
__device__ __forceinline__ void update_one(const Consts& k, float& p, float g_in, float d,
                                           float& s0, float& s1) {
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
    const float denom = __fadd_rn(__fsqrt_rn(__fmul_rn(v, k.ibc2)), k.eps);
    p = __fsub_rn(p, __fdiv_rn(__fmul_rn(k.step, m), denom));
    s0 = m;
    s1 = v;
  } else if constexpr (R == Rule::lion) {
    const float m = s0;
    const float dir = __fadd_rn(__fmul_rn(k.beta1, m), __fmul_rn(k.omb1, g));
    p = __fsub_rn(p, __fmul_rn(k.lr_wd, p));
    p = __fsub_rn(p, __fmul_rn(k.lr, sign_of(dir)));
    s0 = __fadd_rn(__fmul_rn(k.beta2, m), __fmul_rn(k.omb2, g));
  } else if constexpr (R == Rule::muon) {
    s0 = __fadd_rn(__fmul_rn(k.momentum, s0), __fmul_rn(k.omm, g));
    p = __fsub_rn(p, __fmul_rn(k.lr_wd, p));
    p = __fsub_rn(p, __fmul_rn(k.lr, d));
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
inline constexpr DType kOutDType = O == Out::bf16  ? DType::bf16
                                   : O == Out::f16 ? DType::f16
                                                   : DType::f32;

inline const char* rule_name(Rule r) {
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
    case Rule::muon:
      return "muon";
  }
  return "?";
}

/// 8-bit moments (update_q8.cu): `runs` are the checked, non-empty runs in begin order.
void update_q8(const cpu::UpdateHyper* hypers, int num_hypers, const std::vector<UpdateRun>& runs,
               const cpu::UpdateArgs& a, cudaStream_t stream);

}  // namespace zeroshard::cuda::detail
