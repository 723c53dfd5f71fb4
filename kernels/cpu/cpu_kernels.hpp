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
struct UpdateHyper {
  OptimizerKind kind = OptimizerKind::adamw;
  float lr = 0, beta1 = 0, beta2 = 0, eps = 0, weight_decay = 0, momentum = 0;
  bool nesterov = false;
  float bias_correction1 = 1;  ///< 1 − beta1^t (Adam/AdamW)
  float bias_correction2 = 1;  ///< 1 − beta2^t (Adam/AdamW)
  float grad_scale = 1;        ///< unscale × clip × 1/(ranks × micro-steps), applied to g first
};

/// One fused optimizer pass over n elements:
///   g = float(grad[i]) * grad_scale, then the optimizer's update of master[i] and its state,
///   then out[i] = convert(master[i]) when out is non-null (the low-precision parameter copy).
/// state0/state1: Adam/AdamW m and v; SGD momentum buffer in state0 (may be null when
/// momentum == 0); Lion m in state0. Unused states may be null.
/// Update rules (all in f32):
///   adam:  g += wd*p; m = b1*m + (1-b1)*g; v = b2*v + (1-b2)*g*g;
///          p -= lr * (m/bc1) / (sqrt(v/bc2) + eps)
///   adamw: p -= lr*wd*p  (i.e. p = p - (lr*wd)*p), then as adam without the g += wd*p
///   sgd:   g += wd*p; if momentum != 0: buf = momentum*buf + g; g = nesterov ? g + momentum*buf :
///   buf;
///          p -= lr*g
///   lion:  c = b1*m + (1-b1)*g; p = p - (lr*wd)*p; p -= lr*sign(c); m = b2*m + (1-b2)*g
///          (sign(0) = 0)
struct UpdateArgs {
  float* master = nullptr;
  float* state0 = nullptr;
  float* state1 = nullptr;
  const void* grad = nullptr;
  DType grad_dtype = DType::f32;
  void* out = nullptr;
  DType out_dtype = DType::f32;
  int64_t n = 0;
};
void optimizer_update(Isa isa, const UpdateHyper& h, const UpdateArgs& a);

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
