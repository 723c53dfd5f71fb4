// Bad input never crashes: mutated JSON configurations, random registrations through the public
// API, and damaged checkpoint manifests and data-file headers either work or throw
// zeroshard::Error, never another exception, a crash or a silent
// acceptance of something the engine cannot hold. A short, seeded fuzz run: the same inputs
// every time, so a failure reproduces.

#include <gtest/gtest.h>

#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "src/checkpoint/format.hpp"
#include "zeroshard/zeroshard.hpp"

namespace zeroshard {
namespace {

const char* kSeeds[] = {
    R"({"zero_optimization": {"stage": 2}, "bf16": {"enabled": true}})",
    R"({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2,
        "gradient_clipping": 1.0, "optimizer": {"type": "AdamW",
        "params": {"lr": 0.001, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}},
        "fp16": {"enabled": true, "loss_scale": 0, "initial_scale_power": 16,
        "loss_scale_window": 1000, "hysteresis": 2, "min_loss_scale": 1},
        "zero_optimization": {"stage": 3, "overlap_comm": true, "reduce_bucket_size": 5e8,
        "offload_optimizer": {"device": "cpu", "pin_memory": true}}})",
    R"({"zeroshard": {"shard_alignment": 64, "grad_buffers": 3, "max_live_units": 4,
        "prefetch": false, "collective_timeout_s": 30}})",
};

// Replacements that stress the reader: out-of-range numbers, wrong types, NUL bytes, nesting.
const char* kTokens[] = {"1e309",
                         "-1",
                         "0",
                         "18446744073709551616",
                         "9223372036854775807",
                         "-0.0",
                         "NaN",
                         "\"\"",
                         "null",
                         "[]",
                         "{}",
                         "true",
                         "1.5",
                         "\"cuda\"",
                         "\"nvme\"",
                         "4096",
                         "1e-45",
                         "2147483648"};

std::string mutate(std::string s, std::mt19937& g) {
  std::uniform_int_distribution<int> op(0, 4);
  const int edits = g() % 2 == 0 ? 1 : 2;
  for (int e = 0; e < edits && !s.empty(); ++e) {
    const size_t at = g() % s.size();
    switch (op(g)) {
      case 0:  // a number or literal replaced by another token
        s.replace(at, std::min<size_t>(s.size() - at, 1 + g() % 4),
                  kTokens[g() % std::size(kTokens)]);
        break;
      case 1:
        s[at] = char(g() % 256);  // NUL bytes and every other byte value included
        break;
      case 2:
        s.erase(at, 1 + g() % 8);
        break;
      case 3:
        s.insert(at, s.substr(g() % s.size(), 1 + g() % 16));
        break;
      default:
        s.insert(at, 1, '\0');
        break;
    }
  }
  return s;
}

TEST(Fuzz, MutatedConfigsParseOrThrowError) {
  std::mt19937 g(12345);
  int parsed = 0, refused = 0;
  for (int i = 0; i < 4000; ++i) {
    const std::string text = mutate(kSeeds[size_t(i) % std::size(kSeeds)], g);
    try {
      Config c = Config::from_json(text);
      c.validate();  // what the reader returns is valid
      ++parsed;
    } catch (const Error&) {
      ++refused;
    } catch (const std::exception& e) {
      ADD_FAILURE() << "not a zeroshard::Error: " << e.what() << "\ninput: " << text;
    }
  }
  // Both outcomes occur: the mutations are neither all harmless nor all fatal.
  EXPECT_GT(parsed, 10);
  EXPECT_GT(refused, 400);
}

// Random shapes, names, groups and alignments: add_unit() and finalize() either work or throw
// Error. Units small enough to allocate are finalized and stepped; huge ones must be refused at
// registration, before any arithmetic on their sizes can overflow.
TEST(Fuzz, RandomRegistrationsWorkOrThrowError) {
  std::mt19937_64 g(777);
  const int64_t dims[] = {0,
                          1,
                          3,
                          7,
                          128,
                          1 << 20,
                          int64_t(1) << 31,
                          int64_t(1) << 40,
                          std::numeric_limits<int64_t>::max(),
                          -1};
  const int64_t aligns[] = {1, 8, 128, 4096, int64_t(1) << 20, int64_t(1) << 31, int64_t(1) << 62,
                            0, -8};
  const char* names[] = {"w", "b", "", "layer.0.weight", "w"};
  int finalized = 0, refused = 0;
  for (int i = 0; i < 300; ++i) {
    Config cfg;
    cfg.stage = int(g() % 4);
    cfg.shard_alignment = aligns[g() % std::size(aligns)];
    try {
      Engine e(cfg, make_self_communicator());
      int64_t total = 0;
      const int units = 1 + int(g() % 3);
      for (int u = 0; u < units; ++u) {
        std::vector<Param> ps;
        const int np = int(g() % 3);
        for (int p = 0; p < np; ++p) {
          Param q;
          q.name = names[g() % std::size(names)];
          for (int d = int(g() % 4); d > 0; --d) q.shape.push_back(dims[g() % std::size(dims)]);
          q.group = g() % 8 == 0 ? 1 : 0;
          ps.push_back(q);
        }
        std::string name = g() % 10 == 0 ? "" : "u" + std::to_string(g() % 3);
        try {
          e.add_unit(name, ps);
          for (const Param& q : ps) {
            int64_t n = 1;
            for (int64_t d : q.shape)
              n = d > 0 && n > (int64_t(1) << 40) / d ? int64_t(1) << 41 : n * d;
            total += n;
          }
        } catch (const Error&) {
          ++refused;
        }
      }
      // What registered and is small enough to hold here is finalized and trained one step.
      if (e.num_units() > 0 && total <= (1 << 22) && cfg.shard_alignment <= 4096) {
        e.finalize();
        for (int u = e.num_units() - 1; u >= 0; --u) {
          e.grads(u);
          e.grads_ready(u);
        }
        e.step();
        ++finalized;
      }
    } catch (const Error&) {
      ++refused;
    } catch (const std::exception& ex) {
      ADD_FAILURE() << "not a zeroshard::Error: " << ex.what() << " (case " << i << ")";
    }
  }
  EXPECT_GT(finalized, 10);
  EXPECT_GT(refused, 10);
}

TEST(Fuzz, HugeShapesAndAlignmentsAreRefusedByName) {
  Engine e(Config{}, make_self_communicator());
  const int64_t big = int64_t(1) << 40;
  try {
    e.add_unit("huge", {Param{"w", {big, big}}});
    ADD_FAILURE() << "a shape of 2^80 elements was accepted";
  } catch (const Error& err) {
    EXPECT_EQ(err.code(), ErrorCode::invalid_argument);
    EXPECT_NE(std::string(err.what()).find("'w'"), std::string::npos) << err.what();
  }
  try {
    e.add_unit("", {Param{"w", {3}}});
    ADD_FAILURE() << "an empty unit name was accepted";
  } catch (const Error& err) {
    EXPECT_NE(std::string(err.what()).find("empty"), std::string::npos) << err.what();
  }
  try {
    e.add_unit("u", {Param{"", {3}}});
    ADD_FAILURE() << "an empty parameter name was accepted";
  } catch (const Error& err) {
    EXPECT_NE(std::string(err.what()).find("empty"), std::string::npos) << err.what();
  }
  Config cfg;
  cfg.shard_alignment = int64_t(1) << 62;
  try {
    cfg.validate();
    ADD_FAILURE() << "shard_alignment 2^62 was accepted";
  } catch (const Error& err) {
    EXPECT_NE(std::string(err.what()).find("shard_alignment"), std::string::npos) << err.what();
  }
}

}  // namespace
}  // namespace zeroshard

// ---- checkpoint manifests and data-file headers ---------------------------------------------

namespace zeroshard {
namespace {

ckpt::Manifest sample_manifest() {
  ckpt::Manifest m;
  m.tag = "step00000007";
  m.save_id = 0x0123456789abcdefull;
  m.world_size = 2;
  m.stage = 3;
  m.dtype = "bf16";
  m.optimizer = "adamw";
  m.step = 7;
  m.scaler = {1024.0f, 2, 5, 1};
  m.groups = {OptimizerOptions{}, OptimizerOptions{}};
  m.groups[1].weight_decay = 0;
  m.states = {"master", "state0", "state1"};
  m.state_format = StateFormat::q8;
  m.state_block = 1;  // the ranges below start anywhere
  m.block_bytes = 1 << 20;
  m.units = {{"embed", 6, {{"w", {2, 3}}}}, {"head", 5, {{"w", {5}}, {"b", {0}}}}};
  m.ranges = {{{0, 0, 4, 0}, {1, 0, 3, 4}}, {{0, 4, 6, 0}, {1, 3, 5, 2}}};
  return m;
}

// Mutated manifests parse or throw Error; one that parses is one the loader can trust (every
// unit covered exactly once by the ranges).
TEST(Fuzz, MutatedCheckpointManifestsParseOrThrowError) {
  const std::string seed = ckpt::manifest_text(sample_manifest());
  ASSERT_NO_THROW(ckpt::parse_manifest(seed, "seed"));
  std::mt19937 g(777);
  int refused = 0;
  for (int i = 0; i < 3000; ++i) {
    const std::string text = mutate(seed, g);
    try {
      const ckpt::Manifest m = ckpt::parse_manifest(text, "fuzz");
      for (size_t u = 0; u < m.units.size(); ++u) {
        int64_t covered = 0;
        for (const auto& list : m.ranges)
          for (const ckpt::Range& r : list)
            if (r.unit == int(u)) covered += r.end - r.begin;
        EXPECT_EQ(covered, m.units[u].numel) << "input: " << text;
      }
    } catch (const Error&) {
      ++refused;
    } catch (const std::exception& e) {
      ADD_FAILURE() << "not a zeroshard::Error: " << e.what() << "\ninput: " << text;
    }
  }
  EXPECT_GT(refused, 2500);  // nearly every change breaks the JSON, a rule or the checksum
}

// Headers with bytes changed, truncated or random are refused with Error, never trusted.
TEST(Fuzz, DamagedDataFileHeadersAreRefused) {
  const std::vector<char> good = ckpt::encode_header({42, 1, 2, 1 << 20, 4096});
  const ckpt::FileHeader h = ckpt::decode_header(good.data(), good.size(), "good");
  EXPECT_EQ(h.save_id, 42u);
  EXPECT_EQ(h.data_bytes, 4096);
  std::mt19937 g(99);
  for (int i = 0; i < 3000; ++i) {
    std::vector<char> bad = good;
    size_t len = bad.size();
    switch (i % 3) {
      case 0:  // one to three bytes of the fixed part changed
        for (int k = 0, n = 1 + int(g() % 3); k < n; ++k) bad[g() % 56] ^= char(1 + g() % 255);
        break;
      case 1:
        len = g() % 56;  // cut short
        break;
      default:
        for (char& c : bad) c = char(g());
        break;
    }
    EXPECT_THROW(ckpt::decode_header(bad.data(), len, "fuzz"), Error) << "case " << i;
  }
}

}  // namespace
}  // namespace zeroshard
