#pragma once
// The fused optimizer update, written once for every vector type V (scalar_vec.hpp lists the
// interface). One pass per element: read master, state and grad, write master, state and the
// optional low-precision copy, so the update moves the fewest bytes possible. Every ISA runs
// the same IEEE operations in the same order per lane, which is what makes it bitwise equal to
// the scalar reference (the build adds -ffp-contract=off so no FMA sneaks in).

#include <cstdint>
#include <type_traits>

#include "kernels/cpu/cpu_kernels.hpp"
#include "kernels/cpu/scalar_vec.hpp"
#include "kernels/cpu/update_rules.hpp"
#include "kernels/cpu/vec_io.hpp"

namespace zeroshard::cpu {
namespace {

// The folded constants splat into vectors once per call, outside the element loop.
template <class V>
struct Broadcast {
  using T = typename V::T;
  T lr, beta1, beta2, eps, wd, momentum, bc1, bc2, grad_scale, omb1, omb2, lr_wd;
  explicit Broadcast(const UpdateConsts& c)
      : lr(V::set1(c.lr)),
        beta1(V::set1(c.beta1)),
        beta2(V::set1(c.beta2)),
        eps(V::set1(c.eps)),
        wd(V::set1(c.wd)),
        momentum(V::set1(c.momentum)),
        bc1(V::set1(c.bc1)),
        bc2(V::set1(c.bc2)),
        grad_scale(V::set1(c.grad_scale)),
        omb1(V::set1(c.omb1)),
        omb2(V::set1(c.omb2)),
        lr_wd(V::set1(c.lr_wd)) {}
};

// Elements [begin, end) with V; end - begin must be a multiple of V::kWidth. The formulas are
// the ones documented in cpu_kernels.hpp, parenthesised exactly as C++ parses them there.
template <class V, Rule R, DType G, Out O>
void update_range(const UpdateConsts& c, const UpdateArgs& a, int64_t begin, int64_t end) {
  using T = typename V::T;
  const Broadcast<V> k(c);
  // Local copies: the compiler cannot prove that stores through float* leave `a` unchanged.
  float* const master = a.master;
  float* const s0 = a.state0;
  float* const s1 = a.state1;
  // Element sizes for prefetch addressing (the out size is unused when O is none).
  const size_t grad_bytes = G == DType::f32 ? 4 : 2;
  const size_t out_bytes = O == Out::f32 ? 4 : 2;
  for (int64_t i = begin; i < end; i += V::kWidth) {
    // One prefetch per stream and cache line of f32 (half-width streams get two per line).
    if (V::kWidth >= kLineElems || i % kLineElems == 0) {
      prefetch_ahead(master, i, 4);
      prefetch_ahead(a.grad, i, grad_bytes);
      if constexpr (R != Rule::sgd) prefetch_ahead(s0, i, 4);
      if constexpr (R == Rule::adam || R == Rule::adamw) prefetch_ahead(s1, i, 4);
      if constexpr (O != Out::none) prefetch_ahead(a.out, i, out_bytes);
    }
    T p = V::load_f32(master + i);
    T g = load_as<V, G>(a.grad, i) * k.grad_scale;
    if constexpr (R == Rule::adam || R == Rule::adamw) {
      T m = V::load_f32(s0 + i);
      T v = V::load_f32(s1 + i);
      // Adam folds decay into the gradient (L2); AdamW decays the weight itself, first.
      if constexpr (R == Rule::adam) {
        g = g + k.wd * p;
      } else {
        p = p - k.lr_wd * p;
      }
      m = k.beta1 * m + k.omb1 * g;
      v = k.beta2 * v + k.omb2 * g * g;
      const T denom = V::sqrt(v / k.bc2) + k.eps;
      p = p - k.lr * (m / k.bc1) / denom;
      V::store_f32(s0 + i, m);
      V::store_f32(s1 + i, v);
    } else if constexpr (R == Rule::lion) {
      // The direction interpolates with beta1, the stored momentum decays with beta2.
      T m = V::load_f32(s0 + i);
      const T dir = k.beta1 * m + k.omb1 * g;
      p = p - k.lr_wd * p;
      p = p - k.lr * V::sign(dir);
      m = k.beta2 * m + k.omb2 * g;
      V::store_f32(s0 + i, m);
    } else {
      g = g + k.wd * p;
      if constexpr (R == Rule::sgd_momentum || R == Rule::sgd_nesterov) {
        const T buf = k.momentum * V::load_f32(s0 + i) + g;
        V::store_f32(s0 + i, buf);
        if constexpr (R == Rule::sgd_nesterov) {
          g = g + k.momentum * buf;
        } else {
          g = buf;
        }
      }
      p = p - k.lr * g;
    }
    // The low-precision copy is written in the same pass: no second read of the master.
    V::store_f32(master + i, p);
    if constexpr (O == Out::f32) store_as<V, DType::f32>(a.out, i, p);
    if constexpr (O == Out::bf16) store_as<V, DType::bf16>(a.out, i, p);
    if constexpr (O == Out::f16) store_as<V, DType::f16>(a.out, i, p);
  }
}

// Full vectors with V, then the remainder with the scalar lane type (same operations).
template <class V, Rule R, DType G, Out O>
void update_all(const UpdateConsts& c, const UpdateArgs& a) {
  const int64_t full = a.n - a.n % V::kWidth;
  update_range<V, R, G, O>(c, a, 0, full);
  if constexpr (!std::is_same_v<V, ScalarVec>) update_range<ScalarVec, R, G, O>(c, a, full, a.n);
}

// momentum == 0 is plain SGD whatever `nesterov` says (torch rejects that pair; we ignore it),
// so no momentum buffer is read or written.

// Run-time → compile-time switches: each combination becomes its own branch-free loop.

/// The KernelTable entry: resolves rule × grad dtype × out dtype to one instantiation. The
/// constants are folded here, once per call, so vector body and scalar tail share them.
template <class V>
void optimizer_update_impl(const UpdateHyper& h, const UpdateArgs& a) {
  const UpdateConsts c = fold_consts(h);
  with_rule(rule_of(h), [&](auto rule) {
    with_dtype(a.grad_dtype, [&](auto grad) {
      with_out(out_of(a), [&](auto out) {
        update_all<V, decltype(rule)::value, decltype(grad)::value, decltype(out)::value>(c, a);
      });
    });
  });
}

}  // namespace
}  // namespace zeroshard::cpu
