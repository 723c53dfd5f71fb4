#pragma once
// Internal interface of the CPU kernels (not installed). Every kernel works on one contiguous
// range, single-threaded; the engine splits work into chunks and runs them on its TBB arena.
//
// Exactness contract: for every Isa the results are bitwise equal to Isa::scalar for the same
// inputs (same operation order per element, no FMA contraction, IEEE sqrt and divide, round to
// nearest even on every narrowing conversion), except sum_squares, whose lane-parallel
// summation order differs per ISA (documented bound: relative 1e-12).

#include <cstdint>

#include "zeroshard/config.hpp"
#include "zeroshard/types.hpp"

namespace zeroshard::cpu {

enum class Isa : uint8_t { scalar, avx2, avx512 };
const char* isa_name(Isa isa);
/// The widest ISA this CPU supports, capped by the environment variable ZEROSHARD_CPU_ISA
/// ("scalar", "avx2", "avx512") when set. Detected once.
Isa best_isa();
/// True if this CPU can run `isa`.
bool isa_supported(Isa isa);

/// Hyperparameters of one update, folded on the host (in double, then cast to float).
/// The state arrays an optimizer keeps per element: Adam and AdamW m and v, Lion m, SGD its
/// momentum buffer when a group has momentum.
inline int num_states(OptimizerKind kind, bool momentum) {
  switch (kind) {
    case OptimizerKind::adam:
    case OptimizerKind::adamw:
      return 2;
    case OptimizerKind::lion:
    case OptimizerKind::muon:
      return 1;
    case OptimizerKind::sgd:
      return momentum ? 1 : 0;
  }
  return 0;
}

struct UpdateHyper {
  OptimizerKind kind = OptimizerKind::adamw;
  float lr = 0, beta1 = 0, beta2 = 0, eps = 0, weight_decay = 0, momentum = 0;
  bool nesterov = false;
  float bias_correction1 = 1;  ///< 1 − beta1^t (Adam/AdamW)
  float bias_correction2 = 1;  ///< 1 − beta2^t (Adam/AdamW)
  float grad_scale = 1;        ///< unscale × clip × 1/(ranks × micro-steps), applied to g first
  /// A run of parameters that got no gradient on any rank this step: master and state stay as
  /// they are, and out[i] = convert(master[i]) only (the other fields are not read).
  bool hold = false;
};

/// One fused optimizer pass over n elements:
///   g = float(grad[i]) * grad_scale, then the optimizer's update of master[i] and its state,
///   then out[i] = convert(master[i]) when out is non-null (the low-precision parameter copy).
/// state0/state1: Adam/AdamW m and v; SGD momentum buffer in state0 (may be null when
/// momentum == 0); Lion m in state0. Unused states may be null.
/// Update rules (all in f32):
///   adam:  g += wd*p; m = b1*m + (1-b1)*g; v = b2*v + (1-b2)*g*g;
///          p -= (step*m) / (sqrt(v*ibc2) + eps), with step = lr/bc1 and ibc2 = 1/bc2 folded
///          once per call in f32 (one divide and one square root per element)
///   adamw: p -= lr*wd*p  (i.e. p = p - (lr*wd)*p), then as adam without the g += wd*p
///   sgd:   g += wd*p; if momentum != 0: buf = momentum*buf + g; g = nesterov ? g + momentum*buf :
///   buf;
///          p -= lr*g
///   lion:  c = b1*m + (1-b1)*g; p = p - (lr*wd)*p; p -= lr*sign(c); m = b2*m + (1-b2)*g
///          (sign(0) = 0)
///   muon:  m = momentum*m + (1-momentum)*g; p = p - (lr*wd)*p; p -= lr*dir[i], where dir is
///          the step's orthogonalised direction, scaled per matrix (src/muon/), made before the
///          update from the same m and g
/// The moments are stored as state_format says (Config::optimizer_state) and widened to f32
/// for the update:
///   f32:  float arrays.
///   bf16: uint16_t arrays; rounded to nearest even when stored.
///   q8:   uint8_t arrays of codes (quant_code.hpp; state0 uses the signed code, state1 the
///         unsigned one) with one f32 absmax per `block` elements in absmax0/absmax1. The
///         range starts at a block boundary and ends at one or at the end of the buffer, since
///         a block is requantized whole: each block is dequantized (point × absmax) as the
///         update reads it, updated into f32 scratch, and requantized (absmax = max |value|,
///         code = that of the nearest point to value × (1 / absmax), an all-zero block all 0).
/// The master weights are f32, or bf16 (Config::bf16_master) rounded stochastically after every
/// update: widened to f32 for it, then element i (counted from the unit's element 0 as
/// `index + i`, modulo 2^32) rounds with the bits cvt::rounding_bits(round_key, index + i), up
/// with probability (the f32's dropped bits) / 2^16. The copy-out is the rounded value, so a
/// bf16 out equals the master's bits. The key is rounding_key(step, unit): every ISA, world size
/// and stage rounds each element of each step alike, and a resumed run bitwise as the first.
struct UpdateArgs {
  void* master = nullptr;
  DType master_dtype = DType::f32;  ///< f32, or bf16 (stochastic rounding)
  uint32_t round_key = 0;           ///< bf16 master: rounding_key(step, unit)
  int64_t index = 0;                ///< bf16 master: element 0's index in its unit
  void* state0 = nullptr;
  void* state1 = nullptr;
  StateFormat state_format = StateFormat::f32;
  float* absmax0 = nullptr;  ///< q8: one per block of state0
  float* absmax1 = nullptr;  ///< q8: one per block of state1
  int64_t block = 0;         ///< q8: elements per block (at most kMaxStateBlock)
  const void* grad = nullptr;
  DType grad_dtype = DType::f32;
  void* out = nullptr;
  DType out_dtype = DType::f32;
  /// muon: the direction, f32, indexed like grad (read only by a muon group's elements).
  const float* dir = nullptr;
  int64_t n = 0;
};
/// Largest q8 block: a block's two moments are widened on the stack (32 KiB).
inline constexpr int64_t kMaxStateBlock = 4096;
/// Bytes per element of a moment stored as `f` (q8: without its absmax).
inline size_t state_bytes(StateFormat f) {
  return f == StateFormat::f32 ? 4 : f == StateFormat::bf16 ? 2 : 1;
}

void optimizer_update(Isa isa, const UpdateHyper& h, const UpdateArgs& a);
/// The stochastic rounding's key of one unit's update in one step (UpdateArgs::round_key).
uint32_t rounding_key(int64_t step, int unit);

/// Elements [begin, end) of an update's range that use the hyperparameters *h.
struct UpdateSegment {
  int64_t begin = 0, end = 0;
  const UpdateHyper* h = nullptr;
};
/// A q8 update whose blocks hold several parameter groups (or padding): element i is updated
/// with the segment containing it; elements in none keep their value (and are requantized
/// with their block, if a segment touches it; a block no segment touches is left as it is).
/// Segments are ascending and disjoint, inside [0, a.n), of one optimizer kind.
void optimizer_update_segments(Isa isa, const UpdateSegment* segments, int count,
                               const UpdateArgs& a);

/// q8 (de)quantization on its own, as the update does it: blocks of `block` elements from
/// element 0 (the last one may be shorter), the signed or the unsigned code. For checkpoints
/// and read_shard(), which see moments in f32. dequantize → quantize is the identity on a q8
/// state (codes and absmax bit for bit) where every point × absmax is a normal float (absmax ≥
/// 2^-94): ±1.0 are points, so max |x| of a dequantized block is its absmax, and every other
/// point × absmax × (1 / absmax) rounds back to its code. Below, the smallest points × absmax
/// are denormal or 0 and may come back as other codes.
void quantize_blocks(Isa isa, const float* x, int64_t n, int64_t block, bool is_signed, uint8_t* q,
                     float* absmax);
void dequantize_blocks(Isa isa, const uint8_t* q, const float* absmax, int64_t n, int64_t block,
                       bool is_signed, float* x);

/// One moment of n elements stored as `f` (its absmax too for q8), widened to f32 or narrowed
/// from it: f32 copies, bf16 converts (round to nearest even), q8 (de)quantizes blocks from
/// element 0 (quantize_blocks()). For read_shard(), write_shard() and checkpoints, on every
/// tier alike; narrow(widen(x)) gives x's bits back.
void widen_moment(Isa isa, StateFormat f, const void* data, const float* absmax, int64_t n,
                  int64_t block, bool is_signed, float* out);
void narrow_moment(Isa isa, StateFormat f, const float* in, int64_t n, int64_t block,
                   bool is_signed, void* data, float* absmax);

/// Σ float(x[i])², accumulated in double.
double sum_squares(Isa isa, const void* x, DType dtype, int64_t n);
/// dst[i] = convert(src[i]) (any pair of dtypes; same dtype is a copy).
void convert(Isa isa, const void* src, DType src_dtype, void* dst, DType dst_dtype, int64_t n);
/// acc[i] += float(g[i]).
void accumulate(Isa isa, float* acc, const void* g, DType g_dtype, int64_t n);
/// inout[i] = round(float(inout[i]) + float(in[i])) for bf16/f16 (the reduction operator of
/// low-precision collectives); for f32 a plain add.
void add_into(Isa isa, void* inout, const void* in, DType dtype, int64_t n);
/// Memory-traffic reference for benchmarks: reads `read_streams` arrays and writes
/// `write_streams` arrays of n floats each with no arithmetic (the same bytes an update moves).
void same_bytes(Isa isa, const float* const* reads, int read_streams, float* const* writes,
                int write_streams, int64_t n);

// Scalar conversions, the reference for every ISA.
float bf16_to_float(uint16_t h);
uint16_t float_to_bf16(float f);  ///< round to nearest even; NaN stays a quiet NaN
float f16_to_float(uint16_t h);
uint16_t float_to_f16(float f);  ///< IEEE round to nearest even, subnormals and inf included

}  // namespace zeroshard::cpu
