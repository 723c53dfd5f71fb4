// StagedParamTier, the GPU engine's stage-3 parameter tier for shards off the GPU, on the CPU
// backend (a GPU's copies become memcpy): every gather source is a staging copy of the inner
// tier's shard, at most two are out at once, and a slot comes back whether the gather landed or
// was dropped. The GPU engine's bitwise parity with the CPU engine on these tiers is
// tests/gpu/test_gpu_engine.cpp's (params_host / params_nvme cases).
#include <gtest/gtest.h>

#include <cstring>
#include <memory>
#include <vector>

#include "base/ledger.hpp"
#include "kernels/cpu/arena.hpp"
#include "src/compute/compute.hpp"
#include "src/tiers/memory_param_tier.hpp"
#include "src/tiers/staged_param_tier.hpp"
#include "zeroshard/config.hpp"

namespace zeroshard {
namespace {

struct Fixture {
  Config cfg;
  std::vector<UnitShape> units;
  Ledger ledger;
  cpu::Arena arena{1};
  std::unique_ptr<Compute> cpu = make_cpu_compute(arena);
  TierContext ctx;
  MemoryParamTier* inner = nullptr;
  std::unique_ptr<StagedParamTier> tier;

  explicit Fixture(std::vector<int64_t> shards) {
    cfg.stage = 3;
    cfg.dtype = DType::bf16;
    for (size_t i = 0; i < shards.size(); ++i) {
      UnitShape u;
      u.layout.name = "u" + std::to_string(i);
      u.layout.numel = u.layout.padded_numel = u.layout.shard_numel = shards[i];
      units.push_back(u);
    }
    ctx.cfg = &cfg;
    ctx.units = &units;
    ctx.pdt = DType::bf16;
    ctx.pbytes = 2;
    ctx.ledger = &ledger;
    ctx.buffer = [this](Tier t, MemKind k, const char* name, size_t bytes, bool pin) {
      (void)pin;  // no mlock in a test
      return Buffer(&ledger, t, k, name, bytes);
    };
    auto p = std::make_unique<MemoryParamTier>(ctx, Tier::host, *cpu, *cpu);
    inner = p.get();
    tier = std::make_unique<StagedParamTier>(ctx, std::move(p), *cpu);
    for (size_t i = 0; i < shards.size(); ++i) {
      std::vector<float> v(size_t(shards[i]));
      for (size_t j = 0; j < v.size(); ++j) v[j] = float(i + 1) + float(j) / 64.0f;
      tier->load_initial(int(i), v.data());
    }
  }
  bool holds_shard(const void* src, int u) {
    return src != inner->own(u) &&
           std::memcmp(src, inner->own(u), size_t(ctx.shard(u)) * ctx.pbytes) == 0;
  }
};

TEST(StagedParamTier, GathersFromStagingCopiesTwoAtATime) {
  Fixture f({24, 40, 8});
  // The slots live on the device tier, sized by the largest shard.
  EXPECT_EQ(f.ledger.report().at(Tier::device, MemKind::buffer), 2 * 40 * 2);
  EXPECT_EQ(f.ledger.report().at(Tier::host, MemKind::param), (24 + 40 + 8) * 2);
  const void* a = f.tier->gather_source(0);
  const void* b = f.tier->gather_source(1);
  ASSERT_NE(a, nullptr);
  ASSERT_NE(b, nullptr);
  EXPECT_NE(a, b);
  EXPECT_TRUE(f.holds_shard(a, 0));
  EXPECT_TRUE(f.holds_shard(b, 1));
  // Both slots feed gathers in flight: the engine must let one land first.
  EXPECT_EQ(f.tier->gather_source(2), nullptr);
  f.tier->gathered(0);
  f.tier->gathered(0);  // again (the engine's landing loop, then gather()): harmless
  const void* c = f.tier->gather_source(2);
  ASSERT_NE(c, nullptr);
  EXPECT_TRUE(f.holds_shard(c, 2));
  // A dropped prefetch (released without gathered) gives its slot back too.
  f.tier->released(1);
  const void* d = f.tier->gather_source(0);
  ASSERT_NE(d, nullptr);
  EXPECT_TRUE(f.holds_shard(d, 0));
}

TEST(StagedParamTier, UpdatesGoToTheInnerTier) {
  Fixture f({16, 16});
  EXPECT_EQ(f.tier->whole(0), nullptr);
  EXPECT_EQ(f.tier->own(1), f.inner->own(1));  // the CPU update writes the shard in place
  std::vector<float> master(16, 0.5f);
  f.tier->restore(1, master.data());
  EXPECT_EQ(f.tier->read(1), master);
  const void* src = f.tier->gather_source(1);
  ASSERT_NE(src, nullptr);
  EXPECT_TRUE(f.holds_shard(src, 1));  // a gather after the update sends the new values
}

}  // namespace
}  // namespace zeroshard
