#pragma once
// The passes over a unit's reduced gradient on the arena: folding a micro-step into the f32
// accumulator, and the step's norm. The norm is summed as Arena::parallel_sum sums (fixed
// chunks of kChunk elements, in chunk order), so a sum taken while a chunk is folded is bitwise
// the sum a separate pass over the result would give; it costs no extra trip through memory.

#include <cstdint>

#include "kernels/cpu/arena.hpp"

namespace zeroshard::cpu {

/// Σ float(x[i])² over n elements of dtype, in double.
double parallel_sum_squares(Arena& arena, const void* x, DType dtype, int64_t n);

/// acc[i] = float(g[i]) when `first`, else acc[i] += float(g[i]), over n elements. With
/// `sum`, returns Σ acc[i]² of the result, each chunk summed right after it is written (still
/// in cache); else 0.
double fold_grad(Arena& arena, float* acc, const void* g, DType g_dtype, int64_t n, bool first,
                 bool sum);

}  // namespace zeroshard::cpu
