// The public 8-bit quantization (zeroshard/quantize.hpp): the CPU kernels' own, at the best ISA.
#include "zeroshard/quantize.hpp"

#include <bit>

#include "kernels/cpu/cpu_kernels.hpp"
#include "kernels/cpu/quant_code.hpp"

namespace zeroshard {

std::array<float, 256> code_points_8bit(bool is_signed) {
  std::array<float, 256> out;
  for (int q = 0; q < 256; ++q)
    out[size_t(q)] = std::bit_cast<float>(is_signed ? cpu::Q8Code<true>::point_bits(uint8_t(q))
                                                    : cpu::Q8Code<false>::point_bits(uint8_t(q)));
  return out;
}

void quantize_8bit(const float* x, int64_t n, int64_t block, bool is_signed, uint8_t* codes,
                   float* absmax) {
  cpu::quantize_blocks(cpu::best_isa(), x, n, block, is_signed, codes, absmax);
}

void dequantize_8bit(const uint8_t* codes, const float* absmax, int64_t n, int64_t block,
                     bool is_signed, float* x) {
  cpu::dequantize_blocks(cpu::best_isa(), codes, absmax, n, block, is_signed, x);
}

}  // namespace zeroshard
