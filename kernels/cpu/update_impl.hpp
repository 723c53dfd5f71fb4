#pragma once
// The fused optimizer update, written once for every vector type V (scalar_vec.hpp lists the
// interface). One pass per element: read master, state and grad, write master, state and the
// optional low-precision copy, so the update moves the fewest bytes possible. Every ISA runs
// the same IEEE operations in the same order per lane, which is what makes it bitwise equal to
// the scalar reference (the build adds -ffp-contract=off so no FMA sneaks in).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

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

// Where the update reads and writes the moments. Element i of the range is element i of each
// accessor. narrow<U>() is the accessor of the scalar tail; absorb() takes back what it found.

// f32 or bf16 moments, read and written in place.
template <class V, DType S>
struct PlainMoments {
  using T = typename V::T;
  void* s0;
  void* s1;
  T load0(int64_t i) const { return load_as<V, S>(s0, i); }
  T load1(int64_t i) const { return load_as<V, S>(s1, i); }
  void store0(int64_t i, T x) { store_as<V, S>(s0, i, x); }
  void store1(int64_t i, T x) { store_as<V, S>(s1, i, x); }
  template <bool Uses0, bool Uses1>
  void prefetch(int64_t i) const {
    if constexpr (Uses0) prefetch_ahead(s0, i, S == DType::f32 ? 4 : 2);
    if constexpr (Uses1) prefetch_ahead(s1, i, S == DType::f32 ? 4 : 2);
  }
  template <class U>
  PlainMoments<U, S> narrow() const {
    return {s0, s1};
  }
  void absorb(const PlainMoments<ScalarVec, S>&) {}
};

// q8 moments of one block: decoded from their codes as they are read (× the block's absmax),
// written in f32 to the block's buffers, where they are requantized once the whole block is
// updated; the running max |x| of what was written is that requantization's absmax (NaN
// ignored, as block_absmax()).
template <class V>
struct BlockMoments {
  using T = typename V::T;
  const uint8_t* q0;
  const uint8_t* q1;
  float a0, a1;  // the block's absmax before the update
  float* m;
  float* v;
  T wide0 = V::set1(a0), wide1 = V::set1(a1);
  T max0 = V::zero(), max1 = V::zero();
  float tail0 = 0.0f, tail1 = 0.0f;  // the scalar tail's max
  T load0(int64_t i) const { return V::template decode8<true>(q0 + i, wide0); }
  T load1(int64_t i) const { return V::template decode8<false>(q1 + i, wide1); }
  void store0(int64_t i, T x) {
    V::store_f32(m + i, x);
    max0 = V::max(V::abs(x), max0);
  }
  void store1(int64_t i, T x) {
    V::store_f32(v + i, x);
    max1 = V::max(V::abs(x), max1);
  }
  // One code byte per element: one prefetch per 64.
  template <bool Uses0, bool Uses1>
  void prefetch(int64_t i) const {
    if (i % 64 != 0) return;
    if constexpr (Uses0) prefetch_ahead(q0, i, 1);
    if constexpr (Uses1) prefetch_ahead(q1, i, 1);
  }
  template <class U>
  BlockMoments<U> narrow() const {
    return {q0, q1, a0, a1, m, v};
  }
  void absorb(const BlockMoments<ScalarVec>& t) {
    tail0 = t.max0;
    tail1 = t.max1;
  }
  float absmax0() const { return std::max(V::reduce_max(max0), tail0); }
  float absmax1() const { return std::max(V::reduce_max(max1), tail1); }
};

// Elements [begin, end) with V; end - begin must be a multiple of V::kWidth. The formulas are
// the ones documented in cpu_kernels.hpp, parenthesised exactly as C++ parses them there. The
// moments are read and written through st (above), the master is stored as M (f32, or bf16
// rounded stochastically), and everything is updated in f32.
template <class V, Rule R, DType G, Out O, DType M, class St>
void update_range(const UpdateConsts& c, const UpdateArgs& a, St& moments, int64_t begin,
                  int64_t end) {
  using T = typename V::T;
  const Broadcast<V> k(c);
  // A local copy, as `a` below: its fields then stay in registers across the loop's stores.
  St st = moments;
  // Local copies: the compiler cannot prove that stores through float* leave `a` unchanged.
  void* const master = a.master;
  const uint32_t key = a.round_key;
  const uint32_t index0 = uint32_t(a.index);  // modulo 2^32, as documented
  // Element sizes for prefetch addressing (the out size is unused when O is none).
  const size_t grad_bytes = G == DType::f32 ? 4 : 2;
  const size_t out_bytes = O == Out::f32 ? 4 : 2;
  const size_t master_bytes = M == DType::f32 ? 4 : 2;
  for (int64_t i = begin; i < end; i += V::kWidth) {
    // One prefetch per stream and cache line of f32 (half-width streams get two per line).
    if (V::kWidth >= kLineElems || i % kLineElems == 0) {
      prefetch_ahead(master, i, master_bytes);
      prefetch_ahead(a.grad, i, grad_bytes);
      st.template prefetch<R != Rule::sgd, R == Rule::adam || R == Rule::adamw>(i);
      if constexpr (O != Out::none) prefetch_ahead(a.out, i, out_bytes);
      if constexpr (R == Rule::muon) prefetch_ahead(a.dir, i, 4);
    }
    T p = load_as<V, M>(master, i);
    T g = load_as<V, G>(a.grad, i) * k.grad_scale;
    if constexpr (R == Rule::adam || R == Rule::adamw) {
      T m = st.load0(i);
      T v = st.load1(i);
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
      st.store0(i, m);
      st.store1(i, v);
    } else if constexpr (R == Rule::lion) {
      // The direction interpolates with beta1, the stored momentum decays with beta2.
      T m = st.load0(i);
      const T dir = k.beta1 * m + k.omb1 * g;
      p = p - k.lr_wd * p;
      p = p - k.lr * V::sign(dir);
      m = k.beta2 * m + k.omb2 * g;
      st.store0(i, m);
    } else if constexpr (R == Rule::muon) {
      // The momentum is averaged here; the step's direction was made from the same average
      // (and orthogonalised) before the update, in dir (docs/muon.md).
      const T buf = k.momentum * st.load0(i) + k.omm * g;
      st.store0(i, buf);
      p = p - k.lr_wd * p;
      p = p - k.lr * load_as<V, DType::f32>(a.dir, i);
    } else {
      g = g + k.wd * p;
      if constexpr (R == Rule::sgd_momentum || R == Rule::sgd_nesterov) {
        const T buf = k.momentum * st.load0(i) + g;
        st.store0(i, buf);
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
  moments = st;
}

// Full vectors with V, then the remainder with the scalar lane type (same operations).
template <class V, Rule R, DType G, Out O, DType M, class St>
void update_all(const UpdateConsts& c, const UpdateArgs& a, St& st) {
  const int64_t full = a.n - a.n % V::kWidth;
  update_range<V, R, G, O, M>(c, a, st, 0, full);
  if constexpr (!std::is_same_v<V, ScalarVec>) {
    auto tail = st.template narrow<ScalarVec>();
    update_range<ScalarVec, R, G, O, M>(c, a, tail, full, a.n);
    st.absorb(tail);
  }
}

// momentum == 0 is plain SGD whatever `nesterov` says (torch rejects that pair; we ignore it),
// so no momentum buffer is read or written.

// Run-time → compile-time switches: each combination becomes its own branch-free loop.

/// Resolves rule × grad dtype × out dtype × master dtype to one instantiation:
/// run.template operator()<R, G, O, M>(). A bf16 master comes with a bf16 model
/// (Config::bf16_master), so only its bf16 copy-out (or none) and f32 or bf16 gradients are
/// instantiated with it.
template <class Run>
void with_update_types(const UpdateHyper& h, const UpdateArgs& a, Run&& run) {
  with_rule(rule_of(h), [&](auto rule) {
    constexpr Rule R = decltype(rule)::value;
    with_dtype(a.grad_dtype, [&](auto grad) {
      constexpr DType G = decltype(grad)::value;
      with_out(out_of(a), [&](auto out) {
        constexpr Out O = decltype(out)::value;
        if constexpr (G != DType::f16 && (O == Out::none || O == Out::bf16)) {
          if (a.master_dtype == DType::bf16) return run.template operator()<R, G, O, DType::bf16>();
        }
        run.template operator()<R, G, O, DType::f32>();
      });
    });
  });
}

/// f32 or bf16 moments. The constants are folded here, once per call, so vector body and scalar
/// tail share them.
template <class V>
void update_plain(const UpdateHyper& h, const UpdateArgs& a) {
  const UpdateConsts c = fold_consts(h);
  with_update_types(h, a, [&]<Rule R, DType G, Out O, DType M>() {
    if (a.state_format == StateFormat::bf16) {
      PlainMoments<V, DType::bf16> st{a.state0, a.state1};
      update_all<V, R, G, O, M>(c, a, st);
    } else {
      PlainMoments<V, DType::f32> st{a.state0, a.state1};
      update_all<V, R, G, O, M>(c, a, st);
    }
  });
}

// ---- q8 moments: each block decoded as the update reads it, requantized after ---------------

// out[i] = the point of q[i] × absmax, elements [0, n) (quant_code.hpp); returns max |out|.
template <class V, bool S>
float dequantize_block(const uint8_t* q, float absmax, float* out, int64_t n) {
  float top = 0.0f;
  split_tail<V>(n, [&]<class U>(int64_t begin, int64_t end) {
    const typename U::T a = U::set1(absmax);
    typename U::T acc = U::zero();
    for (int64_t i = begin; i < end; i += U::kWidth) {
      const typename U::T x = U::template decode8<S>(q + i, a);
      U::store_f32(out + i, x);
      acc = U::max(U::abs(x), acc);
    }
    top = std::max(U::reduce_max(acc), top);
  });
  return top;
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

// q = the codes of x[0, n) × (1 / absmax), whose absmax is given; an all-zero (or all-NaN)
// block, absmax 0, is all codes of 0. x × (1 / absmax) may exceed 1 by an ulp: it saturates at
// the code of 1. Where 1 / absmax overflows (absmax at most 2^-128: a moment decayed for hundreds
// of steps without a gradient), x / absmax instead, or every 0 would become inf × 0 = NaN.
template <class V, bool S>
void quantize_block(const float* x, uint8_t* q, int64_t n, float absmax) {
  if (!(absmax > 0.0f)) {
    for (int64_t i = 0; i < n; ++i) q[i] = 0;
    return;
  }
  const float inv = 1.0f / absmax;
  const bool tiny = !(inv <= std::numeric_limits<float>::max());
  split_tail<V>(n, [&]<class U>(int64_t begin, int64_t end) {
    const typename U::T s = U::set1(inv), a = U::set1(absmax);
    if (tiny) {
      for (int64_t i = begin; i < end; i += U::kWidth)
        U::template encode8<S>(U::load_f32(x + i) / a, q + i);
    } else {
      for (int64_t i = begin; i < end; i += U::kWidth)
        U::template encode8<S>(U::load_f32(x + i) * s, q + i);
    }
  });
}

// One pass per block over the elements: each segment's update decodes the codes as it reads
// them and writes the moments in f32 to the block's buffers (BlockMoments), taking their new
// absmax as it goes; elements in no segment are decoded on their own. A second pass over the
// buffers, in L1, writes the codes.
template <class V>
void update_q8(const UpdateSegment* segments, int count, const UpdateArgs& a) {
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
  // The constants of each segment, folded once per call rather than once per block.
  std::vector<UpdateConsts> consts(static_cast<size_t>(count));
  for (int s = 0; s < count; ++s) consts[size_t(s)] = fold_consts(*segments[s].h);
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
    const float a0 = q0 ? a.absmax0[blk] : 0.0f, a1 = q1 ? a.absmax1[blk] : 0.0f;
    float top0 = 0.0f, top1 = 0.0f;  // the block's new absmax
    // Elements [from, to) of the block in no segment: decoded as they are.
    auto keep = [&](int64_t from, int64_t to) {
      if (from >= to) return;
      if (q0)
        top0 = std::max(dequantize_block<V, true>(q0 + from, a0, m + (from - b), to - from), top0);
      if (q1)
        top1 = std::max(dequantize_block<V, false>(q1 + from, a1, v + (from - b), to - from), top1);
    };
    int64_t done = b;  // elements before it are in the buffers
    for (int s = first; s < count && segments[s].begin < b + len; ++s) {
      const int64_t lo = segments[s].begin > b ? segments[s].begin : b;
      const int64_t hi = segments[s].end < b + len ? segments[s].end : b + len;
      if (lo >= hi) continue;
      keep(done, lo);
      UpdateArgs p = a;
      p.master = static_cast<char*>(a.master) + size_t(lo) * mbytes;
      p.index = a.index + lo;
      p.grad = static_cast<const char*>(a.grad) + size_t(lo) * gbytes;
      p.out = a.out ? static_cast<char*>(a.out) + size_t(lo) * obytes : nullptr;
      p.dir = a.dir ? a.dir + lo : nullptr;
      p.n = hi - lo;
      BlockMoments<V> st{
          q0 ? q0 + lo : nullptr, q1 ? q1 + lo : nullptr, a0, a1, m + (lo - b), v + (lo - b)};
      with_update_types(*segments[s].h, p, [&]<Rule R, DType G, Out O, DType M>() {
        update_all<V, R, G, O, M>(consts[size_t(s)], p, st);
      });
      // A moment the segment's rule does not keep stays as it was (a Muon group's elements
      // beside AdamW's in one unit, SGD's without momentum beside SGD's with).
      const Rule rule = rule_of(*segments[s].h);
      const bool uses0 = rule != Rule::sgd, uses1 = rule == Rule::adam || rule == Rule::adamw;
      if (q0)
        top0 = std::max(
            uses0 ? st.absmax0() : dequantize_block<V, true>(q0 + lo, a0, m + (lo - b), hi - lo),
            top0);
      if (q1)
        top1 = std::max(
            uses1 ? st.absmax1() : dequantize_block<V, false>(q1 + lo, a1, v + (lo - b), hi - lo),
            top1);
      done = hi;
    }
    keep(done, b + len);
    if (q0) quantize_block<V, true>(m, q0 + b, len, a.absmax0[blk] = top0);
    if (q1) quantize_block<V, false>(v, q1 + b, len, a.absmax1[blk] = top1);
  }
}

template <class V>
void quantize_blocks_impl(const float* x, int64_t n, int64_t block, bool is_signed, uint8_t* q,
                          float* absmax) {
  for (int64_t b = 0; b < n; b += block) {
    const int64_t len = n - b < block ? n - b : block;
    float& a = absmax[b / block];
    a = block_absmax<V>(x + b, len);
    if (is_signed)
      quantize_block<V, true>(x + b, q + b, len, a);
    else
      quantize_block<V, false>(x + b, q + b, len, a);
  }
}

template <class V>
void dequantize_blocks_impl(const uint8_t* q, const float* absmax, int64_t n, int64_t block,
                            bool is_signed, float* x) {
  for (int64_t b = 0; b < n; b += block) {
    const int64_t len = n - b < block ? n - b : block;
    if (is_signed)
      dequantize_block<V, true>(q + b, absmax[b / block], x + b, len);
    else
      dequantize_block<V, false>(q + b, absmax[b / block], x + b, len);
  }
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
