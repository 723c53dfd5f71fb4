// A checkpoint's state encodings (encoding.hpp).
#include "src/checkpoint/encoding.hpp"

#include <algorithm>
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

}  // namespace

Encoding encoding_of(const Manifest& m, int s) {
  const StateKind kind = state_names()[size_t(s)].kind;
  if (kind == StateKind::master) return {};
  return {m.state_format, m.state_block, kind == StateKind::state0};
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

void unpack(const Encoding& e, int64_t n, int64_t lo, int64_t hi, const char* bytes, void* data,
            float* absmax) {
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

void encode(const Encoding& e, const float* values, int64_t n, char* out) {
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
  unpack(e, n, base, base + count, bytes, codes.data(), absmax.data());
  cpu::dequantize_blocks(cpu::best_isa(), codes.data(), absmax.data(), count, e.block, e.is_signed,
                         values.data());
  std::memcpy(out, values.data() + (lo - base), size_t(hi - lo) * 4);
}

}  // namespace zeroshard::ckpt
