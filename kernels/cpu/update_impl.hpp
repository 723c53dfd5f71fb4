#pragma once
// The fused optimizer update, written once for every vector type V (scalar_vec.hpp lists the
// interface). One pass per element: read master, state and grad, write master, state and the
// optional low-precision copy, so the update moves the fewest bytes possible. Every ISA runs
// the same IEEE operations in the same order per lane, which is what makes it bitwise equal to
// the scalar reference (the build adds -ffp-contract=off so no FMA sneaks in).

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "kernels/cpu/cpu_kernels.hpp"
#include "kernels/cpu/quant_code.hpp"
#include "kernels/cpu/scalar_vec.hpp"
#include "kernels/cpu/update_rules.hpp"
#include "kernels/cpu/vec_io.hpp"

namespace zeroshard::cpu {
namespace {

// The folded constants splat into vectors once per call, outside the element loop.
template <class V>
struct Broadcast {
  using T = typename V::T;
  T lr, beta1, beta2, eps, wd, momentum, grad_scale, omb1, omb2, lr_wd, omm, step, ibc2;
  explicit Broadcast(const UpdateConsts& c)
      : lr(V::set1(c.lr)),
        beta1(V::set1(c.beta1)),
        beta2(V::set1(c.beta2)),
        eps(V::set1(c.eps)),
        wd(V::set1(c.wd)),
        momentum(V::set1(c.momentum)),
        grad_scale(V::set1(c.grad_scale)),
        omb1(V::set1(c.omb1)),
        omb2(V::set1(c.omb2)),
        lr_wd(V::set1(c.lr_wd)),
        omm(V::set1(c.omm)),
        step(V::set1(c.step)),
        ibc2(V::set1(c.ibc2)) {}
};

// Elements [begin, end) with V; end - begin must be a multiple of V::kWidth. The formulas are
// the ones documented in cpu_kernels.hpp, parenthesised exactly as C++ parses them there. The
// moments are stored as S (f32 or bf16), the master as M (f32, or bf16 rounded stochastically),
// and updated in f32.
template <class V, Rule R, DType G, Out O, DType S, DType M>
void update_range(const UpdateConsts& c, const UpdateArgs& a, int64_t begin, int64_t end) {
  using T = typename V::T;
  const Broadcast<V> k(c);
  // Local copies: the compiler cannot prove that stores through float* leave `a` unchanged.
  void* const master = a.master;
  const uint32_t key = a.round_key;
  const uint32_t index0 = uint32_t(a.index);  // modulo 2^32, as documented
  void* const s0 = a.state0;
  void* const s1 = a.state1;
  // Element sizes for prefetch addressing (the out size is unused when O is none).
  const size_t grad_bytes = G == DType::f32 ? 4 : 2;
  const size_t out_bytes = O == Out::f32 ? 4 : 2;
  const size_t state_bytes = S == DType::f32 ? 4 : 2;
  const size_t master_bytes = M == DType::f32 ? 4 : 2;
  for (int64_t i = begin; i < end; i += V::kWidth) {
    // One prefetch per stream and cache line of f32 (half-width streams get two per line).
    if (V::kWidth >= kLineElems || i % kLineElems == 0) {
      prefetch_ahead(master, i, master_bytes);
      prefetch_ahead(a.grad, i, grad_bytes);
      if constexpr (R != Rule::sgd) prefetch_ahead(s0, i, state_bytes);
      if constexpr (R == Rule::adam || R == Rule::adamw) prefetch_ahead(s1, i, state_bytes);
      if constexpr (O != Out::none) prefetch_ahead(a.out, i, out_bytes);
      if constexpr (R == Rule::muon) prefetch_ahead(a.dir, i, 4);
    }
    T p = load_as<V, M>(master, i);
    T g = load_as<V, G>(a.grad, i) * k.grad_scale;
    if constexpr (R == Rule::adam || R == Rule::adamw) {
      T m = load_as<V, S>(s0, i);
      T v = load_as<V, S>(s1, i);
      // Adam folds decay into the gradient (L2); AdamW decays the weight itself, first.
      if constexpr (R == Rule::adam) {
        g = g + k.wd * p;
      } else {
        p = p - k.lr_wd * p;
      }
      m = k.beta1 * m + k.omb1 * g;
      v = k.beta2 * v + k.omb2 * g * g;
      // The bias corrections are folded into two constants, so one divide and one square root
      // per element are left: with three divides the update was compute-bound wherever the
      // state is compact (bf16 or 8-bit moments, a bf16 master).
      const T denom = V::sqrt(v * k.ibc2) + k.eps;
      p = p - (k.step * m) / denom;
      store_as<V, S>(s0, i, m);
      store_as<V, S>(s1, i, v);
    } else if constexpr (R == Rule::lion) {
      // The direction interpolates with beta1, the stored momentum decays with beta2.
      T m = load_as<V, S>(s0, i);
      const T dir = k.beta1 * m + k.omb1 * g;
      p = p - k.lr_wd * p;
      p = p - k.lr * V::sign(dir);
      m = k.beta2 * m + k.omb2 * g;
      store_as<V, S>(s0, i, m);
    } else if constexpr (R == Rule::muon) {
      // The momentum is averaged here; the step's direction was made from the same average
      // (and orthogonalised) before the update, in dir (docs/muon.md).
      const T buf = k.momentum * load_as<V, S>(s0, i) + k.omm * g;
      store_as<V, S>(s0, i, buf);
      p = p - k.lr_wd * p;
      p = p - k.lr * load_as<V, DType::f32>(a.dir, i);
    } else {
      g = g + k.wd * p;
      if constexpr (R == Rule::sgd_momentum || R == Rule::sgd_nesterov) {
        const T buf = k.momentum * load_as<V, S>(s0, i) + g;
        store_as<V, S>(s0, i, buf);
        if constexpr (R == Rule::sgd_nesterov) {
          g = g + k.momentum * buf;
        } else {
          g = buf;
        }
      }
      p = p - k.lr * g;
    }
    // A bf16 master rounds once; the copy-out below is then that value.
    if constexpr (M == DType::bf16) p = V::round_bf16_sr(p, key, index0 + uint32_t(i));
    // The low-precision copy is written in the same pass: no second read of the master.
    store_as<V, M>(master, i, p);
    if constexpr (O == Out::f32) store_as<V, DType::f32>(a.out, i, p);
    if constexpr (O == Out::bf16) store_as<V, DType::bf16>(a.out, i, p);
    if constexpr (O == Out::f16) store_as<V, DType::f16>(a.out, i, p);
  }
}

// Full vectors with V, then the remainder with the scalar lane type (same operations).
template <class V, Rule R, DType G, Out O, DType S, DType M>
void update_all(const UpdateConsts& c, const UpdateArgs& a) {
  const int64_t full = a.n - a.n % V::kWidth;
  update_range<V, R, G, O, S, M>(c, a, 0, full);
  if constexpr (!std::is_same_v<V, ScalarVec>)
    update_range<ScalarVec, R, G, O, S, M>(c, a, full, a.n);
}

// momentum == 0 is plain SGD whatever `nesterov` says (torch rejects that pair; we ignore it),
// so no momentum buffer is read or written.

// Run-time → compile-time switches: each combination becomes its own branch-free loop.

/// f32 or bf16 moments: resolves rule × grad dtype × out dtype × state dtype × master dtype to
/// one instantiation. The constants are folded here, once per call, so vector body and scalar
/// tail share them. A bf16 master comes with a bf16 model (Config::bf16_master), so only its
/// bf16 copy-out (or none) and f32 or bf16 gradients are instantiated with it.
template <class V>
void update_plain(const UpdateHyper& h, const UpdateArgs& a) {
  const UpdateConsts c = fold_consts(h);
  const bool bf16_state = a.state_format == StateFormat::bf16;
  with_rule(rule_of(h), [&](auto rule) {
    constexpr Rule R = decltype(rule)::value;
    with_dtype(a.grad_dtype, [&](auto grad) {
      constexpr DType G = decltype(grad)::value;
      with_out(out_of(a), [&](auto out) {
        constexpr Out O = decltype(out)::value;
        // Only f32 and bf16 reach here, so f16 state is not instantiated.
        if constexpr (G != DType::f16 && (O == Out::none || O == Out::bf16)) {
          if (a.master_dtype == DType::bf16) {
            if (bf16_state)
              update_all<V, R, G, O, DType::bf16, DType::bf16>(c, a);
            else
              update_all<V, R, G, O, DType::f32, DType::bf16>(c, a);
            return;
          }
        }
        if (bf16_state)
          update_all<V, R, G, O, DType::bf16, DType::f32>(c, a);
        else
          update_all<V, R, G, O, DType::f32, DType::f32>(c, a);
      });
    });
  });
}

// ---- q8 moments: dequantize a block, update it in f32, requantize it ---------------------------

// out[i] = code[q[i]] × absmax, elements [0, n).
template <class V>
void dequantize_block(const QuantCode& code, const uint8_t* q, float absmax, float* out,
                      int64_t n) {
  const int64_t wide = V::dequantize_wide(code, q, absmax, out, n);  // 0 on most ISAs
  q += wide;
  out += wide;
  split_tail<V>(n - wide, [&]<class U>(int64_t begin, int64_t end) {
    const typename U::T scale = U::set1(absmax);
    const typename U::CodeTable table = U::code_table(code.code);
    for (int64_t i = begin; i < end; i += U::kWidth)
      U::store_f32(out + i, U::gather(table, q + i) * scale);
  });
}

// q = the nearest code points of x[0, n) × (1 / absmax); absmax > 0.
template <class V>
void quantize_with(const QuantCode& code, const float* x, uint8_t* q, int64_t n, float absmax) {
  // One reciprocal per block, a multiply per element: x × (1/absmax) may exceed 1 by an ulp,
  // which the lookup's last bucket absorbs (it maps to ±1's nearest code point).
  const float inv = 1.0f / absmax;
  split_tail<V>(n, [&]<class U>(int64_t begin, int64_t end) {
    const typename U::T s = U::set1(inv);
    for (int64_t i = begin; i < end; i += U::kWidth)
      U::quantize(code, U::load_f32(x + i) * s, q + i);
  });
}

// A block's absmax: max |x| over [0, n), NaN ignored (+0 where nothing else is left).
template <class V>
float block_absmax(const float* x, int64_t n) {
  float absmax = 0.0f;
  split_tail<V>(n, [&]<class U>(int64_t begin, int64_t end) {
    typename U::T acc = U::set1(absmax);
    for (int64_t i = begin; i < end; i += U::kWidth) acc = U::max(U::abs(U::load_f32(x + i)), acc);
    absmax = U::reduce_max(acc);
  });
  return absmax;
}

// Quantizes x[0, n), whose absmax is given, into q; an all-zero block is the code's 0.
template <class V>
void quantize_scaled(const QuantCode& code, const float* x, uint8_t* q, int64_t n, float absmax) {
  if (absmax > 0.0f) return quantize_with<V>(code, x, q, n, absmax);
  for (int64_t i = 0; i < n; ++i) q[i] = code.zero;
}

// Quantizes x[0, n) into q and returns the block's new absmax (0 for an all-zero block).
template <class V>
float quantize_block(const QuantCode& code, const float* x, uint8_t* q, int64_t n) {
  const float absmax = block_absmax<V>(x, n);
  quantize_scaled<V>(code, x, q, n, absmax);
  return absmax;
}

// quantize_block() of both moments of a block, bitwise the same, with the two lookups
// interleaved: their gathers (to tables of their own) then overlap.
template <class V>
void quantize_both(const QuantCode& c0, const float* m, uint8_t* q0, float& absmax0,
                   const QuantCode& c1, const float* v, uint8_t* q1, float& absmax1, int64_t n) {
  const float a0 = block_absmax<V>(m, n), a1 = block_absmax<V>(v, n);
  absmax0 = a0;
  absmax1 = a1;
  if (!(a0 > 0.0f) || !(a1 > 0.0f)) {  // an all-zero block: each on its own
    quantize_scaled<V>(c0, m, q0, n, a0);
    quantize_scaled<V>(c1, v, q1, n, a1);
    return;
  }
  const float inv0 = 1.0f / a0, inv1 = 1.0f / a1;  // as quantize_with()
  split_tail<V>(n, [&]<class U>(int64_t begin, int64_t end) {
    const typename U::T s0 = U::set1(inv0), s1 = U::set1(inv1);
    for (int64_t i = begin; i < end; i += U::kWidth) {
      U::quantize(c0, U::load_f32(m + i) * s0, q0 + i);
      U::quantize(c1, U::load_f32(v + i) * s1, q1 + i);
    }
  });
}

template <class V>
void update_q8(const UpdateSegment* segments, int count, const UpdateArgs& a) {
  const QuantCode& c0 = dynamic_code(true);
  const QuantCode& c1 = dynamic_code(false);
  // The moments the rules keep (an SGD without momentum keeps none, but may share the unit
  // with an SGD group that has momentum).
  bool keeps0 = false, keeps1 = false;
  for (int s = 0; s < count; ++s) {
    const Rule rule = rule_of(*segments[s].h);
    keeps0 |= rule != Rule::sgd;
    keeps1 |= rule == Rule::adam || rule == Rule::adamw;
  }
  auto* q0 = keeps0 ? static_cast<uint8_t*>(a.state0) : nullptr;
  auto* q1 = keeps1 ? static_cast<uint8_t*>(a.state1) : nullptr;
  alignas(64) float m[kMaxStateBlock];
  alignas(64) float v[kMaxStateBlock];
  const size_t gbytes = a.grad_dtype == DType::f32 ? 4 : 2;
  const size_t obytes = a.out_dtype == DType::f32 ? 4 : 2;
  const size_t mbytes = a.master_dtype == DType::f32 ? 4 : 2;
  int first = 0;  // the first segment that ends past the block's start
  for (int64_t b = 0; b < a.n; b += a.block) {
    const int64_t len = a.n - b < a.block ? a.n - b : a.block;
    const int64_t blk = b / a.block;
    // A block no segment touches is left as it is (the GPU kernel does the same).
    while (first < count && segments[first].end <= b) ++first;
    if (first == count || segments[first].begin >= b + len) continue;
    if (q0) dequantize_block<V>(c0, q0 + b, a.absmax0[blk], m, len);
    if (q1) dequantize_block<V>(c1, q1 + b, a.absmax1[blk], v, len);
    for (int s = first; s < count && segments[s].begin < b + len; ++s) {
      const int64_t lo = segments[s].begin > b ? segments[s].begin : b;
      const int64_t hi = segments[s].end < b + len ? segments[s].end : b + len;
      if (lo >= hi) continue;
      UpdateArgs p = a;
      p.master = static_cast<char*>(a.master) + size_t(lo) * mbytes;
      p.index = a.index + lo;
      p.state0 = q0 ? m + (lo - b) : nullptr;
      p.state1 = q1 ? v + (lo - b) : nullptr;
      p.state_format = StateFormat::f32;
      p.grad = static_cast<const char*>(a.grad) + size_t(lo) * gbytes;
      p.out = a.out ? static_cast<char*>(a.out) + size_t(lo) * obytes : nullptr;
      p.dir = a.dir ? a.dir + lo : nullptr;
      p.n = hi - lo;
      update_plain<V>(*segments[s].h, p);
    }
    if (q0 && q1) {
      quantize_both<V>(c0, m, q0 + b, a.absmax0[blk], c1, v, q1 + b, a.absmax1[blk], len);
    } else {
      if (q0) a.absmax0[blk] = quantize_block<V>(c0, m, q0 + b, len);
      if (q1) a.absmax1[blk] = quantize_block<V>(c1, v, q1 + b, len);
    }
  }
}

// Blocks that are exactly a dequantized block (code × A) come back as the same codes and A.
// max |x| is A unless the largest magnitude sat on the signed map's most negative point
// (−0.99297, there is no −1): then A is recovered from it, trying the neighbouring floats of
// max |x| / |code[0]|, and kept only if the block then dequantizes to x bit for bit.
template <class V>
void quantize_blocks_impl(const float* x, int64_t n, int64_t block, bool is_signed, uint8_t* q,
                          float* absmax) {
  const QuantCode& code = dynamic_code(is_signed);
  alignas(64) float back[kMaxStateBlock];
  for (int64_t b = 0; b < n; b += block) {
    const int64_t len = n - b < block ? n - b : block;
    float& a = absmax[b / block];
    a = quantize_block<V>(code, x + b, q + b, len);
    if (!is_signed || !(a > 0.0f) || len > kMaxStateBlock) continue;
    auto restores = [&](float cand) {
      dequantize_block<V>(code, q + b, cand, back, len);
      return std::memcmp(back, x + b, size_t(len) * 4) == 0;
    };
    if (restores(a)) continue;
    float guess = a / -code.code[0];
    for (int k = 0; k < 3; ++k) guess = std::nextafter(guess, 0.0f);
    bool found = false;
    for (int k = 0; k < 7 && !found; ++k, guess = std::nextafter(guess, INFINITY)) {
      quantize_with<V>(code, x + b, q + b, len, guess);
      if (restores(guess)) a = guess, found = true;
    }
    if (!found) a = quantize_block<V>(code, x + b, q + b, len);  // not a dequantized block
  }
}

template <class V>
void dequantize_blocks_impl(const uint8_t* q, const float* absmax, int64_t n, int64_t block,
                            bool is_signed, float* x) {
  const QuantCode& code = dynamic_code(is_signed);
  for (int64_t b = 0; b < n; b += block)
    dequantize_block<V>(code, q + b, absmax[b / block], x + b, n - b < block ? n - b : block);
}

/// The KernelTable entries.
template <class V>
void optimizer_update_impl(const UpdateHyper& h, const UpdateArgs& a) {
  if (a.state_format == StateFormat::q8) {
    const UpdateSegment whole{0, a.n, &h};
    update_q8<V>(&whole, 1, a);
  } else {
    update_plain<V>(h, a);
  }
}

template <class V>
void optimizer_update_segments_impl(const UpdateSegment* segments, int count, const UpdateArgs& a) {
  update_q8<V>(segments, count, a);
}

}  // namespace
}  // namespace zeroshard::cpu
