// Builds the dynamic code tables (quant_code.hpp). Compiled without -m flags: plain data, read
// by every ISA's kernels.

#include "kernels/cpu/quant_code.hpp"

#include <algorithm>
#include <bit>
#include <cmath>
#include <limits>
#include <vector>

#include "base/check.hpp"

namespace zeroshard::cpu {
namespace {

// The published construction with 8 bits and 7 exponent bits: for the decimal exponents
// 10^-6 .. 10^0, the midpoints of 2^i (signed) or 2^(i+1) (unsigned) equal steps of
// [0.1, 1], each scaled by its power of ten; then 0 and 1.0. Computed in double and rounded to
// f32 once: the published code computes it in f32 steps, which may differ in the last bit of a
// code point (tests/python compare the two).
std::vector<double> published_points(bool is_signed) {
  std::vector<double> points;
  for (int i = 0; i < 7; ++i) {
    const int items = (is_signed ? (1 << i) : (1 << (i + 1))) + 1;
    const double scale = std::pow(10.0, double(i - 6));
    for (int j = 0; j + 1 < items; ++j) {
      const double a = 0.1 + 0.9 * double(j) / double(items - 1);
      const double b = 0.1 + 0.9 * double(j + 1) / double(items - 1);
      points.push_back(scale * (a + b) / 2.0);
      if (is_signed) points.push_back(-scale * (a + b) / 2.0);
    }
  }
  points.push_back(0.0);
  points.push_back(1.0);
  return points;
}

// Exact count of midpoints below x: the definition the bucket table must reproduce.
int count_below(const QuantCode& c, float x) {
  int q = 0;
  while (q < 255 && c.mid[q] < x) ++q;
  return q;
}

QuantCode build(bool is_signed) {
  QuantCode c{};
  std::vector<double> points = published_points(is_signed);
  ZS_CHECK(points.size() == 256);
  std::sort(points.begin(), points.end());
  for (int i = 0; i < 256; ++i) c.code[i] = float(points[size_t(i)]);
  for (int i = 0; i < 255; ++i) {
    ZS_CHECK(c.code[i] < c.code[i + 1]);
    c.mid[i] = (c.code[i] + c.code[i + 1]) / 2.0f;
  }
  c.mid[255] = std::numeric_limits<float>::infinity();
  c.zero = uint8_t(std::find(c.code, c.code + 256, 0.0f) - c.code);
  for (int i = 0; i < 256; ++i)
    for (int b = 0; b < 4; ++b)
      c.plane[b][i] = uint8_t(std::bit_cast<uint32_t>(c.code[i]) >> (8 * b));
  // Each bucket's value range, low end to high end; the last covers only ±1.0 (inputs are
  // normalised) and NaN.
  for (int sign = 0; sign < 2; ++sign) {
    for (int32_t k = 0; k < QuantCode::kBuckets; ++k) {
      const uint32_t first = k == 0 ? 0u : uint32_t(QuantCode::kMinKey + k) << QuantCode::kKeyShift;
      const uint32_t last =
          k == QuantCode::kBuckets - 1
              ? first
              : (uint32_t(QuantCode::kMinKey + k + 1) << QuantCode::kKeyShift) - 1;
      float lo_mag = std::bit_cast<float>(first), hi_mag = std::bit_cast<float>(last);
      const float xa = sign ? -hi_mag : lo_mag, xb = sign ? -lo_mag : hi_mag;
      const int qa = count_below(c, xa), qb = count_below(c, xb);
      // At most one midpoint in the bucket: then one compare decides. It lies inside, so its
      // top 16 bits are the bucket's (never so in the clamped first and last buckets).
      ZS_CHECK(qb - qa <= 1);
      uint32_t t = 0xFFFFu;
      if (qb > qa) {
        const uint32_t m = std::bit_cast<uint32_t>(c.mid[qa]);
        ZS_CHECK(k > 0 && k < QuantCode::kBuckets - 1 &&
                 QuantCode::bucket(m) == QuantCode::bucket(std::bit_cast<uint32_t>(xa)));
        t = QuantCode::low_bits(m);
      }
      c.entry[sign * QuantCode::kBuckets + k] = uint32_t(qa) | t << 8;
    }
  }
  return c;
}

}  // namespace

const QuantCode& dynamic_code(bool is_signed) {
  static const QuantCode s = build(true);
  static const QuantCode u = build(false);
  return is_signed ? s : u;
}

}  // namespace zeroshard::cpu
