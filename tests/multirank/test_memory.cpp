// The ledger's model-state bytes per rank equal the ZeRO formulas exactly (with Ψ the padded
// parameter count, which is what is allocated), and each working buffer equals its own formula.
// Expected values are computed here from the configuration, not read from the engine's layout.
#include <gtest/gtest.h>

#include <algorithm>

#include "tests/multirank/harness.hpp"

using namespace zeroshard;
using zs_test::world;

namespace {

struct Sizes {
  int64_t psi = 0;      // Σ padded unit sizes
  int64_t largest = 0;  // largest padded unit
};

Sizes model_sizes(const std::vector<zs_test::UnitSpec>& model, int n, int64_t align) {
  Sizes s;
  for (const auto& u : model) {
    int64_t numel = 0;
    for (const auto& p : u.params) numel += shape_numel(p.second);
    int64_t grain = n * align,
            padded = std::max<int64_t>((numel + grain - 1) / grain * grain, grain);
    s.psi += padded;
    s.largest = std::max(s.largest, padded);
  }
  return s;
}

int64_t buffer(const MemoryReport& r, const std::string& name) {
  for (const auto& b : r.buffers)
    if (b.name == name) return b.bytes;
  return 0;
}

TEST(Memory, LedgerEqualsZeroFormulas) {
  const int n = world()->size();
  auto model = zs_test::uneven_model();
  for (DType dt : {DType::bf16, DType::f32}) {
    for (int stage = 0; stage <= 3; ++stage) {
      for (int k : {1, 2}) {
        Config cfg;
        cfg.stage = stage;
        cfg.dtype = dt;
        cfg.gradient_accumulation_steps = k;
        cfg.shard_alignment = 8;
        Engine e(cfg, world());
        zs_test::register_model(e, model);
        const Sizes s = model_sizes(model, n, cfg.shard_alignment);
        const int64_t P = int64_t(dtype_size(dt)), psi = s.psi, sh = psi / n;
        // Mixed precision (K = 12: f32 master, m, v): the ZeRO paper's per-stage formulas. An f32
        // model's master weights are its parameters (K = 8 beyond them), so master adds nothing.
        const int64_t K = dt == DType::f32 ? 8 : 12;
        int64_t expect_model = 0, expect_grad_shard = 0, expect_staging = 0, expect_gather = 0;
        switch (stage) {
          case 0:
            expect_model = P * psi + P * psi + K * psi;
            expect_grad_shard = P * sh;
            break;
          case 1:
            expect_model = P * psi + P * psi + K * sh;
            expect_grad_shard = P * sh;
            break;
          case 2:
            expect_model = P * psi + (P + K) * sh;
            expect_staging = cfg.grad_buffers * s.largest * P;
            break;
          case 3:
            expect_model = (P + P + K) * sh;
            expect_staging = cfg.grad_buffers * s.largest * P;
            expect_gather = cfg.max_live_units * s.largest * P;
            break;
        }
        const int64_t expect_accum = k > 1 ? 4 * (stage == 0 ? psi : sh) : 0;
        MemoryReport r = e.memory();
        SCOPED_TRACE(std::string(dtype_name(dt)) + " stage " + std::to_string(stage) + " k " +
                     std::to_string(k));
        EXPECT_EQ(r.model_state_bytes(), expect_model);
        EXPECT_EQ(buffer(r, "grad_shard"), expect_grad_shard);
        EXPECT_EQ(buffer(r, "grad_staging"), expect_staging);
        EXPECT_EQ(buffer(r, "gather"), expect_gather);
        EXPECT_EQ(buffer(r, "grad_accum"), expect_accum);
        EXPECT_EQ(r.total(),
                  expect_model + expect_grad_shard + expect_staging + expect_gather + expect_accum);
        EXPECT_EQ(r.at(Tier::device, MemKind::optim_state), 8 * (stage == 0 ? psi : sh));
        // Training does not allocate more: peaks stay where finalize() put them.
        zs_test::TrainOptions o;
        o.steps = 2;
        o.micro_batches = k;
        zs_test::train(e, o);
        MemoryReport after = e.memory();
        EXPECT_EQ(after.total(), r.total());
        for (int t = 0; t < kNumTiers; ++t)
          for (int kd = 0; kd < kNumMemKinds; ++kd) EXPECT_EQ(after.peak[t][kd], r.bytes[t][kd]);
      }
    }
  }
}

TEST(Memory, HostOffloadMovesOptimizerStateToHostTier) {
  Config cfg;
  cfg.stage = 3;
  cfg.dtype = DType::bf16;
  cfg.offload_optimizer.tier = Tier::host;
  cfg.offload_param.tier = Tier::host;
  Engine e(cfg, world());
  zs_test::register_model(e, zs_test::uneven_model());
  MemoryReport r = e.memory();
  EXPECT_EQ(r.at(Tier::device, MemKind::master), 0);
  EXPECT_EQ(r.at(Tier::device, MemKind::optim_state), 0);
  EXPECT_EQ(r.at(Tier::device, MemKind::param), 0);
  EXPECT_GT(r.at(Tier::host, MemKind::master), 0);
  EXPECT_EQ(r.at(Tier::host, MemKind::optim_state), 2 * r.at(Tier::host, MemKind::master));
  EXPECT_NE(r.to_string().find("optim_state"), std::string::npos);
}

}  // namespace
