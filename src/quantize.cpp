// The public 8-bit quantization (zeroshard/quantize.hpp): the CPU kernels' own, at the best ISA.
#include "zeroshard/quantize.hpp"

#include <algorithm>

#include "kernels/cpu/cpu_kernels.hpp"
#include "kernels/cpu/quant_code.hpp"

namespace zeroshard {

std::array<float, 256> dynamic_code_points(bool is_signed) {
  std::array<float, 256> out;
  const float* code = cpu::dynamic_code(is_signed).code;
  std::copy(code, code + 256, out.begin());
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
