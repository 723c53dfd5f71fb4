#pragma once
/// \file quantize.hpp
/// The 8-bit blockwise quantization that StateFormat::q8 stores optimizer moments in, on its
/// own: to inspect a checkpoint's moments, or to compare with another implementation.
///
/// The code is the dynamic map of Dettmers et al., "8-bit Optimizers via Block-wise
/// Quantization" (7 decimal exponents; signed for first moments, unsigned for Adam's second).
/// Its points are computed in double and rounded to f32 once. A block of `block` elements,
/// counted from element 0 (the last one may be shorter), has absmax = max |x|. Each element is
/// stored as the index of the code point nearest to x × (1 / absmax), ties to the lower index;
/// an all-zero block stores the index of 0 and absmax 0. Dequantizing gives code[index] × absmax.

#include <array>
#include <cstdint>

#include "zeroshard/export.hpp"

namespace zeroshard {

/// The 256 code points, ascending.
ZS_API std::array<float, 256> dynamic_code_points(bool is_signed);

/// x[0, n) → codes[0, n) and absmax[0, ceil(n / block)). block ≥ 1. Quantizing a dequantized
/// block gives its codes and absmax back, bit for bit. Throws Error (invalid_argument) on a
/// null pointer with n > 0 or a block below 1.
ZS_API void quantize_8bit(const float* x, int64_t n, int64_t block, bool is_signed, uint8_t* codes,
                          float* absmax);
/// codes[0, n) and absmax → x[0, n) = code[codes[i]] × absmax[i / block].
ZS_API void dequantize_8bit(const uint8_t* codes, const float* absmax, int64_t n, int64_t block,
                            bool is_signed, float* x);

}  // namespace zeroshard
