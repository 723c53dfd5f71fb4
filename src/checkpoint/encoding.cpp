// A checkpoint's state encodings (encoding.hpp).
#include "src/checkpoint/encoding.hpp"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <vector>

#include "base/check.hpp"
#include "kernels/cpu/cpu_kernels.hpp"
#include "src/checkpoint/format.hpp"

namespace zeroshard::ckpt {

namespace {

int64_t blocks_of(int64_t n, int64_t block) {
  return (n + block - 1) / block;
}

// The dynamic map's 256 points, ascending, as zeroshard built them up to schema 3: for the
// decimal exponents 10^-6 .. 10^0, the midpoints of 2^i (signed) or 2^(i+1) (unsigned) equal
// steps of [0.1, 1], each scaled by its power of ten; then 0 and 1.0; computed in double and
// rounded to f32 once.
const std::array<float, 256>& dynamic_map(bool is_signed) {
  static const auto build = [](bool sign) {
    std::vector<double> points{0.0, 1.0};
    for (int i = 0; i < 7; ++i) {
      const int items = (sign ? (1 << i) : (1 << (i + 1))) + 1;
      const double scale = std::pow(10.0, double(i - 6));
      for (int j = 0; j + 1 < items; ++j) {
        const double a = 0.1 + 0.9 * double(j) / double(items - 1);
        const double b = 0.1 + 0.9 * double(j + 1) / double(items - 1);
        points.push_back(scale * (a + b) / 2.0);
        if (sign) points.push_back(-scale * (a + b) / 2.0);
      }
    }
    ZS_CHECK(points.size() == 256);
    std::sort(points.begin(), points.end());
    std::array<float, 256> code{};
    for (size_t i = 0; i < 256; ++i) code[i] = float(points[i]);
    return code;
  };
  static const std::array<float, 256> s = build(true), u = build(false);
  return is_signed ? s : u;
}

}  // namespace

Encoding encoding_of(const Manifest& m, int s) {
  const StateKind kind = state_names()[size_t(s)].kind;
  if (kind == StateKind::master) return {};
  return {m.state_format, m.state_block, kind == StateKind::state0, m.q8_dynamic_map};
}

bool unpacks_into(const Encoding& e, StateFormat format, int64_t block) {
  return e.format == format && !e.dynamic_map && (format != StateFormat::q8 || e.block == block);
}

int64_t encoded_bytes(const Encoding& e, int64_t n) {
  switch (e.format) {
    case StateFormat::f32:
      return n * 4;
    case StateFormat::bf16:
      return n * 2;
    case StateFormat::q8:
      return n + 4 * blocks_of(n, e.block);
  }
  ZS_CHECK(false);
  return 0;
}

ByteSpan span_of(const Encoding& e, int64_t n, int64_t lo, int64_t hi) {
  ZS_CHECK(0 <= lo && lo < hi && hi <= n);
  if (e.format != StateFormat::q8) {
    const int64_t size = encoded_bytes(e, 1);
    return {lo * size, hi * size};
  }
  const int64_t first = lo / e.block, last = (hi - 1) / e.block;  // blocks
  const int64_t end = std::min(n, (last + 1) * e.block);          // values of the last block
  return {first * (e.block + 4), last * (e.block + 4) + 4 + (end - last * e.block)};
}

void pack(const Encoding& e, const void* data, const float* absmax, int64_t n, char* out) {
  if (e.format != StateFormat::q8) {
    std::memcpy(out, data, size_t(encoded_bytes(e, n)));
    return;
  }
  const auto* codes = static_cast<const uint8_t*>(data);
  for (int64_t at = 0, j = 0; at < n; at += e.block, ++j) {
    const int64_t len = std::min(e.block, n - at);
    std::memcpy(out, absmax + j, 4);
    std::memcpy(out + 4, codes + at, size_t(len));
    out += 4 + len;
  }
}

namespace {

// unpack() of any q8 encoding, the dynamic map's included.
void unpack_blocks(const Encoding& e, int64_t n, int64_t lo, int64_t hi, const char* bytes,
                   void* data, float* absmax) {
  if (e.format != StateFormat::q8) {
    std::memcpy(data, bytes, size_t(encoded_bytes(e, hi - lo)));
    return;
  }
  ZS_CHECK(lo % e.block == 0);
  auto* codes = static_cast<uint8_t*>(data);
  const int64_t end = std::min(n, ((hi - 1) / e.block + 1) * e.block);  // the span's blocks
  for (int64_t at = lo, j = 0; at < end; at += e.block, ++j) {
    const int64_t len = std::min(e.block, end - at);
    std::memcpy(absmax + j, bytes, 4);
    // The span's last block may hold values past hi: they are not this caller's.
    std::memcpy(codes + (at - lo), bytes + 4, size_t(std::min(len, hi - at)));
    bytes += 4 + len;
  }
}

}  // namespace

void unpack(const Encoding& e, int64_t n, int64_t lo, int64_t hi, const char* bytes, void* data,
            float* absmax) {
  ZS_CHECK(!e.dynamic_map);  // a tier stores only the current code
  unpack_blocks(e, n, lo, hi, bytes, data, absmax);
}

void encode(const Encoding& e, const float* values, int64_t n, char* out) {
  ZS_CHECK(!e.dynamic_map);  // saves write the current code
  if (e.format != StateFormat::q8)
    return cpu::convert(cpu::best_isa(), values, DType::f32, out,
                        e.format == StateFormat::bf16 ? DType::bf16 : DType::f32, n);
  std::vector<uint8_t> codes(static_cast<size_t>(n));
  std::vector<float> absmax(size_t(blocks_of(n, e.block)));
  cpu::quantize_blocks(cpu::best_isa(), values, n, e.block, e.is_signed, codes.data(),
                       absmax.data());
  pack(e, codes.data(), absmax.data(), n, out);
}

void decode(const Encoding& e, int64_t n, int64_t lo, int64_t hi, const char* bytes, float* out) {
  if (e.format != StateFormat::q8)
    return cpu::convert(cpu::best_isa(), bytes,
                        e.format == StateFormat::bf16 ? DType::bf16 : DType::f32, out, DType::f32,
                        hi - lo);
  // The whole blocks the span holds, split back into codes and absmax, dequantized at once.
  const int64_t base = lo / e.block * e.block;
  const int64_t count = std::min(n, ((hi - 1) / e.block + 1) * e.block) - base;
  std::vector<uint8_t> codes(static_cast<size_t>(count));
  std::vector<float> absmax(size_t(blocks_of(count, e.block))), values(static_cast<size_t>(count));
  unpack_blocks(e, n, base, base + count, bytes, codes.data(), absmax.data());
  if (e.dynamic_map) {
    const std::array<float, 256>& code = dynamic_map(e.is_signed);
    for (int64_t i = 0; i < count; ++i)
      values[size_t(i)] = code[codes[size_t(i)]] * absmax[size_t(i / e.block)];
  } else {
    cpu::dequantize_blocks(cpu::best_isa(), codes.data(), absmax.data(), count, e.block,
                           e.is_signed, values.data());
  }
  std::memcpy(out, values.data() + (lo - base), size_t(hi - lo) * 4);
}

}  // namespace zeroshard::ckpt
