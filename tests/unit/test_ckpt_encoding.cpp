// How checkpoints store the moments (src/checkpoint/encoding.hpp): every format decodes what it
// encoded, from any sub-range of a range and from the bytes span_of() names alone; an 8-bit
// range re-encodes to its own bytes (so a save → load → save keeps every code and absmax); and
// a schema-2 manifest, written before the moments had a format, reads as f32 moments; a
// schema-3 manifest's 8-bit moments decode through the dynamic map they were written in.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "base/checksum.hpp"
#include "src/checkpoint/encoding.hpp"
#include "src/checkpoint/format.hpp"
#include "zeroshard/error.hpp"
#include "zeroshard/quantize.hpp"

namespace zeroshard::ckpt {
namespace {

std::vector<float> moments(int64_t n, bool is_signed, uint32_t seed) {
  std::mt19937 g(seed);
  std::normal_distribution<float> d(0.0f, 1e-3f);
  std::vector<float> v(static_cast<size_t>(n));
  for (float& x : v) {
    const float y = d(g);
    x = is_signed ? y : y * y;  // a second moment is never negative
  }
  if (n > 70) std::fill(v.begin() + 64, v.begin() + 70, 0.0f);  // part of a block all zero
  return v;
}

// What each format keeps of a value: f32 all of it, bf16 its rounding to nearest even, q8 its
// code point × its block's absmax (the public quantizer, blocks from the range's start).
std::vector<float> kept(const Encoding& e, const std::vector<float>& v) {
  std::vector<float> out(v);
  const int64_t n = int64_t(v.size());
  if (e.format == StateFormat::bf16)
    for (float& x : out) {
      uint32_t b;
      std::memcpy(&b, &x, 4);
      b = (b + 0x7fffu + ((b >> 16) & 1u)) & 0xffff0000u;
      std::memcpy(&x, &b, 4);
    }
  if (e.format == StateFormat::q8) {
    std::vector<uint8_t> q(v.size());
    std::vector<float> a(size_t((n + e.block - 1) / e.block));
    quantize_8bit(v.data(), n, e.block, e.is_signed, q.data(), a.data());
    dequantize_8bit(q.data(), a.data(), n, e.block, e.is_signed, out.data());
  }
  return out;
}

TEST(CheckpointEncoding, EveryFormatDecodesAnySubRangeFromItsSpanAlone) {
  const Encoding all[] = {{StateFormat::f32, 0, false},
                          {StateFormat::bf16, 0, false},
                          {StateFormat::q8, 64, true},
                          {StateFormat::q8, 256, false}};
  for (const Encoding& e : all)
    for (int64_t n : {1, 63, 64, 65, 300, 1000}) {
      SCOPED_TRACE(std::string(state_format_name(e.format)) + " block " + std::to_string(e.block) +
                   " n " + std::to_string(n));
      const std::vector<float> v = moments(n, e.is_signed, uint32_t(n)), want = kept(e, v);
      std::vector<char> bytes(size_t(encoded_bytes(e, n)));
      const int64_t expect_bytes = e.format == StateFormat::f32 ? 4 * n
                                   : e.format == StateFormat::bf16
                                       ? 2 * n
                                       : n + 4 * ((n + e.block - 1) / e.block);
      ASSERT_EQ(int64_t(bytes.size()), expect_bytes);
      encode(e, v.data(), n, bytes.data());
      std::mt19937 g(7);
      for (int t = 0; t < 40; ++t) {
        int64_t lo = int64_t(g() % uint32_t(n)), hi = int64_t(g() % uint32_t(n)) + 1;
        if (t == 0) lo = 0, hi = n;
        if (lo >= hi) std::swap(lo, hi), ++hi;
        hi = std::min(hi, n);
        const ByteSpan s = span_of(e, n, lo, hi);
        ASSERT_TRUE(0 <= s.first && s.first < s.last && s.last <= int64_t(bytes.size()));
        // Only the span's bytes: what lies outside it must not matter.
        std::vector<char> part(bytes.begin() + s.first, bytes.begin() + s.last);
        std::vector<float> got(size_t(hi - lo), -1.0f);
        decode(e, n, lo, hi, part.data(), got.data());
        EXPECT_EQ(std::memcmp(got.data(), want.data() + lo, got.size() * 4), 0)
            << "[" << lo << ", " << hi << ")";
      }
      // What a load gives back encodes to the same bytes.
      std::vector<float> back(static_cast<size_t>(n));
      decode(e, n, 0, n, bytes.data(), back.data());
      std::vector<char> again(bytes.size());
      encode(e, back.data(), n, again.data());
      EXPECT_EQ(again, bytes);
    }
}

// A tier that stores 8-bit moments hands its codes and absmax over as they are: pack() gives
// encode()'s bytes, and unpack() of any block-aligned part gives them back.
TEST(CheckpointEncoding, StoredMomentsMoveWithoutAConversion) {
  const Encoding e{StateFormat::q8, 64, true};
  const int64_t n = 1000, blocks = (n + 63) / 64;
  const std::vector<float> v = moments(n, true, 3);
  std::vector<uint8_t> codes(static_cast<size_t>(n));
  std::vector<float> absmax(static_cast<size_t>(blocks));
  quantize_8bit(v.data(), n, 64, true, codes.data(), absmax.data());
  std::vector<char> packed(size_t(encoded_bytes(e, n))), encoded(packed.size());
  pack(e, codes.data(), absmax.data(), n, packed.data());
  encode(e, v.data(), n, encoded.data());
  EXPECT_EQ(packed, encoded);
  for (auto [lo, hi] : {std::pair<int64_t, int64_t>{0, n}, {64, 130}, {128, n}, {960, 999}}) {
    const ByteSpan s = span_of(e, n, lo, hi);
    std::vector<uint8_t> c(size_t(hi - lo), 0xee);
    std::vector<float> a(size_t((hi - lo + 63) / 64), -1.0f);
    unpack(e, n, lo, hi, packed.data() + s.first, c.data(), a.data());
    EXPECT_TRUE(std::equal(c.begin(), c.end(), codes.begin() + lo)) << lo << ".." << hi;
    EXPECT_TRUE(std::equal(a.begin(), a.end(), absmax.begin() + lo / 64)) << lo << ".." << hi;
  }
}

// A one-rank, one-unit manifest of n values with 8-bit moments in blocks of 64.
Manifest eight_bit_manifest(int64_t n) {
  Manifest m;
  m.tag = "step00000001";
  m.world_size = 1;
  m.dtype = "bf16";
  m.optimizer = "adamw";
  m.step = 1;
  m.scaler = {1.0f, 2, 0, -1};
  m.groups = {OptimizerOptions{}};
  m.states = {"master", "state0", "state1"};
  m.state_format = StateFormat::q8;
  m.state_block = 64;
  m.block_bytes = 1 << 20;
  m.units = {{"u", n, {{"w", {n}}}}};
  m.ranges = {{{0, 0, n, 0}}};
  return m;
}

// m as an older zeroshard wrote it: another schema, without the fields `drop`, checksummed.
Manifest as_schema(const Manifest& m, int schema, const std::vector<std::string>& drop) {
  nlohmann::json j = nlohmann::json::parse(manifest_text(m));
  j["schema"] = schema;
  for (const std::string& k : drop) j.erase(k);
  j.erase("checksum");
  const std::string body = j.dump();
  char sum[17];
  std::snprintf(sum, sizeof sum, "%016llx",
                static_cast<unsigned long long>(offload::xxh64(body.data(), body.size(), 0)));
  j["checksum"] = sum;
  return parse_manifest(j.dump(1), "old");
}

// A manifest as zeroshard wrote it before schema 3: no state_format, f32 moments.
TEST(CheckpointEncoding, Schema2ManifestsReadAsF32Moments) {
  const Manifest m = eight_bit_manifest(100);
  EXPECT_EQ(parse_manifest(manifest_text(m), "new").state_format, StateFormat::q8);
  EXPECT_EQ(expected_header(m, 0, 1).data_bytes, 100 + 4 * 2);
  const Manifest old = as_schema(m, 2, {"state_format", "state_block"});
  EXPECT_EQ(old.state_format, StateFormat::f32);
  EXPECT_EQ(expected_header(old, 0, 1).data_bytes, 400);
  EXPECT_EQ(range_bytes(old, 0, 2), std::vector<int64_t>{0});
}

// A manifest as zeroshard wrote it in schema 3, when 8-bit moments were codes of the dynamic
// map: its q8 ranges decode as that map's points × absmax (the points built here from the
// published construction written differently: 10^e (0.1 + 0.9 (j + 1/2) / k), k = 2^i signed
// or 2^(i+1) unsigned, within half an f32 ulp), and unpack(), which hands codes over as the
// current code's, refuses them.
TEST(CheckpointEncoding, Schema3EightBitMomentsDecodeThroughTheDynamicMap) {
  const Manifest m = eight_bit_manifest(300);
  EXPECT_FALSE(parse_manifest(manifest_text(m), "new").q8_dynamic_map);
  const Manifest old = as_schema(m, 3, {});
  ASSERT_TRUE(old.q8_dynamic_map);
  // A load takes the current code's bytes as they are, the dynamic map's only through f32.
  for (int s : {1, 2}) {
    EXPECT_TRUE(unpacks_into(encoding_of(m, s), StateFormat::q8, 64));
    EXPECT_FALSE(unpacks_into(encoding_of(m, s), StateFormat::q8, 128));
    EXPECT_FALSE(unpacks_into(encoding_of(m, s), StateFormat::f32, 64));
    EXPECT_FALSE(unpacks_into(encoding_of(old, s), StateFormat::q8, 64));
  }
  EXPECT_TRUE(unpacks_into(encoding_of(old, 0), StateFormat::f32, 64));  // the master
  for (int s : {1, 2}) {
    const Encoding e = encoding_of(old, s);
    ASSERT_TRUE(e.dynamic_map);
    const bool is_signed = s == 1;
    std::vector<double> ref{0.0, 1.0};
    for (int i = 0; i < 7; ++i) {
      const int k = is_signed ? 1 << i : 1 << (i + 1);
      for (int q = 0; q < k; ++q) {
        const double x = std::pow(10.0, i - 6) * (0.1 + 0.9 * (q + 0.5) / k);
        ref.push_back(x);
        if (is_signed) ref.push_back(-x);
      }
    }
    std::sort(ref.begin(), ref.end());
    ASSERT_EQ(ref.size(), 256u);
    // 300 values in blocks of 64: every code, absmax 0.5 then 2 then 0.25 ...
    const int64_t n = 300;
    std::vector<char> bytes(size_t(encoded_bytes(e, n)));
    std::vector<float> absmax;
    char* at = bytes.data();
    for (int64_t b = 0; b < n; b += 64) {
      const float a = std::ldexp(1.0f, int(b / 64) % 3 - 1);
      absmax.push_back(a);
      std::memcpy(at, &a, 4);
      for (int64_t i = b; i < std::min(n, b + 64); ++i) at[4 + (i - b)] = char(uint8_t(i % 256));
      at += 4 + std::min<int64_t>(64, n - b);
    }
    std::vector<float> got(static_cast<size_t>(n));
    decode(e, n, 0, n, bytes.data(), got.data());
    for (int64_t i = 0; i < n; ++i) {
      const double want = ref[size_t(i % 256)] * absmax[size_t(i / 64)];
      EXPECT_NEAR(got[size_t(i)], want, std::abs(want) * 6e-8) << s << " " << i;
    }
    std::vector<uint8_t> codes(static_cast<size_t>(n));
    std::vector<float> a(absmax.size());
    EXPECT_THROW(unpack(e, n, 0, n, bytes.data(), codes.data(), a.data()), Error);
  }
}

}  // namespace
}  // namespace zeroshard::ckpt
