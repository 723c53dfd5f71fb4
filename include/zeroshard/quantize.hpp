#pragma once
/// \file quantize.hpp
/// The 8-bit blockwise quantization that StateFormat::q8 stores optimizer moments in, on its
/// own: to inspect a checkpoint's moments, or to compare with another implementation.
///
/// A block of `block` elements, counted from element 0 (the last one may be shorter), has
/// absmax = max |x| (NaN ignored). Each element is stored as the code of the nearest point to
/// x × (1 / absmax) (x / absmax where 1 / absmax overflows), ties to the larger magnitude;
/// dequantizing gives point[code] × absmax. The points are small floats, 8 per binade, 1.0 the
/// largest: signed (first moments) a sign bit and 127 magnitudes down to 1.25 · 2^-16, unsigned
/// (Adam's second moment) 255 down to 1.25 · 2^-32; code 0 is 0, NaN the largest code (in a
/// block with a nonzero value). The bytes are not FP8's E4M3 or E5M2 layout. An all-zero block
/// stores codes 0 and absmax 0; a block holding ±inf has absmax inf, and its values become
/// x × 0: its finite values 0, its infinities NaN, the largest code (+inf back).
/// docs/configuration.md ("Compact optimizer state") describes the format and what it replaced;
/// tests/python/test_quantize.py compares its error with bitsandbytes' dynamic map.

#include <array>
#include <cstdint>

#include "zeroshard/export.hpp"

namespace zeroshard {

/// The points of the 256 codes, in code order (signed: code 128 + c is minus code c's point,
/// and code 128 is 0 too).
ZS_API std::array<float, 256> code_points_8bit(bool is_signed);

/// x[0, n) → codes[0, n) and absmax[0, ceil(n / block)). block ≥ 1. Quantizing a block this
/// function quantized and dequantize_8bit() dequantized gives its codes and absmax back, bit
/// for bit, where every point × absmax is a normal float (absmax ≥ 2^-94 is enough): not so
/// below, where the smallest become denormal or 0, nor for codes from elsewhere (128 comes back
/// as 0, and a block without a code of ±1.0 gets another absmax). Throws Error (invalid_argument)
/// on a null pointer with n > 0 or a block below 1.
ZS_API void quantize_8bit(const float* x, int64_t n, int64_t block, bool is_signed, uint8_t* codes,
                          float* absmax);
/// codes[0, n) and absmax → x[0, n) = point[codes[i]] × absmax[i / block].
ZS_API void dequantize_8bit(const uint8_t* codes, const float* absmax, int64_t n, int64_t block,
                            bool is_signed, float* x);

}  // namespace zeroshard
