#pragma once
// The optimizer update's run-time choices, shared by the CPU kernels (update_impl.hpp) and the
// CUDA kernels (kernels/cuda/update.cu): which rule an UpdateHyper selects, which copy-out an
// UpdateArgs asks for, the per-call constants folded once on the host, and the switches that
// turn each choice into a template argument. One definition keeps the two backends' arithmetic
// — and so their bits — the same.
//
// Anonymous namespace: see scalar_convert.hpp (each ISA file gets its own copy).

#include <cstdint>
#include <type_traits>

#include "kernels/cpu/cpu_kernels.hpp"

namespace zeroshard::cpu {
namespace {

// SGD's three shapes are separate rules so the momentum branches vanish from the inner loop.
enum class Rule : uint8_t { adam, adamw, sgd, sgd_momentum, sgd_nesterov, lion, muon };
// The low-precision copy-out: none, or the dtype written to UpdateArgs::out.
enum class Out : uint8_t { none, f32, bf16, f16 };

// Per-call constants, folded once in single float operations before any loop, so every ISA and
// the GPU broadcast identical bits.
struct UpdateConsts {
  float lr, beta1, beta2, eps, wd, momentum, grad_scale;
  float omb1, omb2, lr_wd;  // 1 − beta1, 1 − beta2, lr × weight_decay
  float step, ibc2;         // Adam: lr / bias_correction1, 1 / bias_correction2
  float omm;                // 1 − momentum (Muon's average)
};

inline UpdateConsts fold_consts(const UpdateHyper& h) {
  UpdateConsts c{};
  c.lr = h.lr;
  c.beta1 = h.beta1;
  c.beta2 = h.beta2;
  c.eps = h.eps;
  c.wd = h.weight_decay;
  c.momentum = h.momentum;
  c.grad_scale = h.grad_scale;
  c.omb1 = 1.0f - h.beta1;
  c.omb2 = 1.0f - h.beta2;
  c.lr_wd = h.lr * h.weight_decay;
  c.step = h.lr / h.bias_correction1;
  c.ibc2 = 1.0f / h.bias_correction2;
  c.omm = 1.0f - h.momentum;
  return c;
}

inline Rule rule_of(const UpdateHyper& h) {
  switch (h.kind) {
    case OptimizerKind::adam:
      return Rule::adam;
    case OptimizerKind::adamw:
      return Rule::adamw;
    case OptimizerKind::lion:
      return Rule::lion;
    case OptimizerKind::muon:
      return Rule::muon;
    case OptimizerKind::sgd:
      break;
  }
  if (h.momentum == 0.0f) return Rule::sgd;
  return h.nesterov ? Rule::sgd_nesterov : Rule::sgd_momentum;
}

inline Out out_of(const UpdateArgs& a) {
  if (a.out == nullptr) return Out::none;
  switch (a.out_dtype) {
    case DType::f32:
      return Out::f32;
    case DType::bf16:
      return Out::bf16;
    case DType::f16:
      return Out::f16;
  }
  return Out::none;
}

template <Rule R>
using RuleTag = std::integral_constant<Rule, R>;
template <Out O>
using OutTag = std::integral_constant<Out, O>;
template <DType D>
using DTypeTag = std::integral_constant<DType, D>;

/// Calls f(RuleTag<r>{}); the callee reads the rule back as decltype(tag)::value.
template <class F>
void with_rule(Rule r, F&& f) {
  switch (r) {
    case Rule::adam:
      return f(RuleTag<Rule::adam>{});
    case Rule::adamw:
      return f(RuleTag<Rule::adamw>{});
    case Rule::sgd:
      return f(RuleTag<Rule::sgd>{});
    case Rule::sgd_momentum:
      return f(RuleTag<Rule::sgd_momentum>{});
    case Rule::sgd_nesterov:
      return f(RuleTag<Rule::sgd_nesterov>{});
    case Rule::lion:
      return f(RuleTag<Rule::lion>{});
    case Rule::muon:
      return f(RuleTag<Rule::muon>{});
  }
}

/// Calls f(OutTag<o>{}).
template <class F>
void with_out(Out o, F&& f) {
  switch (o) {
    case Out::none:
      return f(OutTag<Out::none>{});
    case Out::f32:
      return f(OutTag<Out::f32>{});
    case Out::bf16:
      return f(OutTag<Out::bf16>{});
    case Out::f16:
      return f(OutTag<Out::f16>{});
  }
}

/// Calls f(DTypeTag<d>{}).
template <class F>
void with_dtype(DType d, F&& f) {
  switch (d) {
    case DType::f32:
      return f(DTypeTag<DType::f32>{});
    case DType::bf16:
      return f(DTypeTag<DType::bf16>{});
    case DType::f16:
      return f(DTypeTag<DType::f16>{});
  }
}

}  // namespace
}  // namespace zeroshard::cpu
