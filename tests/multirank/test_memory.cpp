// The ledger's model-state bytes per rank equal the ZeRO formulas exactly (with Ψ the padded
// parameter count, which is what is allocated), and each working buffer equals its own formula.
// Expected values are computed here from the configuration, not read from the engine's layout.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <functional>

#include "tests/multirank/harness.hpp"

using namespace zeroshard;
using zs_test::world;
namespace fs = std::filesystem;

namespace {

struct Sizes {
  int64_t psi = 0;              // Σ padded unit sizes
  int64_t largest = 0;          // largest padded unit
  std::vector<int64_t> padded;  // every padded unit, largest first
  /// Gradient staging (stages 2–3): one slot per unit out at once, sized by the largest units.
  int64_t staging(int grad_buffers) const {
    int64_t sum = 0;
    for (size_t i = 0; i < padded.size() && i < size_t(grad_buffers); ++i) sum += padded[i];
    return sum;
  }
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
    s.padded.push_back(padded);
  }
  std::sort(s.padded.begin(), s.padded.end(), std::greater<>());
  return s;
}

// The configurations these tests sweep: stage, dtype and accumulation, shards aligned to 8.
Config sweep_config(int stage, DType dt, int k) {
  Config cfg;
  cfg.stage = stage;
  cfg.dtype = dt;
  cfg.gradient_accumulation_steps = k;
  cfg.shard_alignment = 8;
  return cfg;
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
        const Config cfg = sweep_config(stage, dt, k);
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
            expect_staging = s.staging(cfg.grad_buffers) * P;
            break;
          case 3:
            expect_model = (P + P + K) * sh;
            expect_staging = s.staging(cfg.grad_buffers) * P;
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

// One unit holding most of the model (an embedding, say): stage 2's gradient memory (its shard
// plus the staging slots, sized by the largest units) stays below stage 1's whole gradients. A
// trainer that keeps a small unit out in the large slot while the large unit asks for one still
// trains (the free slot too small for it grows), with the results of stage 1, bitwise.
TEST(Memory, StageTwoGradientsStayBelowStageOneWithOneLargeUnit) {
  const std::vector<zs_test::UnitSpec> model = {{"embed", {{"w", {400, 97}}}},
                                                {"layer0", {{"w", {23, 13}}}},
                                                {"layer1", {{"w", {29, 11}}}},
                                                {"head", {{"w", {13, 17}}}}};
  const int n = world()->size();
  const Sizes s = model_sizes(model, n, 8);
  const int64_t P = 2;
  auto fill = [&](Engine& e, int u) {
    std::vector<TensorView> g = e.grads(u);
    for (int64_t i = 0; i < g[0].numel; ++i)
      zs_test::store(g[0].data, g[0].dtype, i,
                     zs_test::synthetic_grad(0.25f, u, i, e.rank(), 0, 0));
  };
  std::vector<float> masters[2];
  int64_t grad_memory[2] = {0, 0};
  for (int stage : {1, 2}) {
    Config cfg;
    cfg.stage = stage;
    cfg.dtype = DType::bf16;
    cfg.shard_alignment = 8;
    cfg.overlap_comm = false;  // each reduction completes in grads_ready(): slots free in order
    Engine e(cfg, world());
    zs_test::register_model(e, model);
    const MemoryReport r = e.memory();
    grad_memory[stage - 1] =
        r.at(Tier::device, MemKind::grad) + buffer(r, "grad_staging") + buffer(r, "grad_shard");
    if (stage == 2) {
      EXPECT_EQ(buffer(r, "grad_staging"), (s.padded[0] + s.padded[1]) * P);
    }
    fill(e, 3);  // head: the small slot, reduced at once
    e.grads_ready(3);
    fill(e, 2);  // layer1 takes the small slot again and stays out...
    fill(e, 1);  // ...so layer0 goes to the large one
    e.grads_ready(2);
    fill(e, 0);  // the embedding, while layer0 is out: the free small slot grows
    e.grads_ready(1);
    e.grads_ready(0);
    e.step();
    if (stage == 2) {
      EXPECT_EQ(buffer(e.memory(), "grad_staging"), 2 * s.largest * P)
          << "the small slot grows to the embedding's size, no more";
    }
    for (int u = 0; u < e.num_units(); ++u) {
      const std::vector<float> m = e.read_shard(u, StateKind::master);
      masters[stage - 1].insert(masters[stage - 1].end(), m.begin(), m.end());
    }
  }
  EXPECT_LT(grad_memory[1], grad_memory[0]) << "stage 2 holds more gradient memory than stage 1";
  EXPECT_TRUE(masters[0] == masters[1]) << "stage 2 trained differently from stage 1";
}

// plan_memory() is the engine's own setup with nothing allocated, so its report equals the
// ledger of the engine it plans, cell by cell and buffer by buffer, on every rank: every stage,
// optimizer tier and (stage 3) parameter tier, dtype, accumulation and world size 1-4.
TEST(Memory, PlanEqualsLedger) {
  const fs::path root = fs::temp_directory_path() / "zeroshard-plan-tests";
  fs::create_directories(root / "a");
  fs::create_directories(root / "b");
  auto model = zs_test::uneven_model();
  model.push_back({"wide", {{"w", {40, 97}}, {"b", {97}}}});
  std::vector<PlanUnit> units;
  for (const auto& u : model) {
    PlanUnit pu{u.name, {}};
    for (const auto& [name, shape] : u.params) pu.params.push_back(Param{name, shape});
    units.push_back(pu);
  }
  int configs = 0;
  for (int stage = 0; stage <= 3; ++stage)
    for (Tier opt : {Tier::device, Tier::host, Tier::nvme})
      for (Tier par : {Tier::device, Tier::host, Tier::nvme}) {
        if ((stage < 3 && par != Tier::device) || (stage == 0 && opt == Tier::nvme)) continue;
        for (DType dt : {DType::bf16, DType::f32})
          for (int k : {1, 2}) {
            Config cfg = sweep_config(stage, dt, k);
            cfg.offload_optimizer.tier = opt;
            cfg.offload_param.tier = par;
            // Its second copy, where a host tier takes it; on nvme, the new shards.
            cfg.speculative_step = k == 2 ? SpeculativeStep::on : SpeculativeStep::off;
            cfg.aio.block_size = 4096;
            for (OffloadOptions* o : {&cfg.offload_optimizer, &cfg.offload_param})
              o->nvme_paths = {(root / "a").string(), (root / "b").string()};
            Engine e(cfg, world());
            zs_test::register_model(e, model);
            const MemoryReport real = e.memory();
            const MemoryReport plan = plan_memory(cfg, units, e.world_size(), e.rank());
            SCOPED_TRACE("stage " + std::to_string(stage) + ", optimizer " + tier_name(opt) +
                         ", parameters " + tier_name(par) + ", " + dtype_name(dt) + ", k " +
                         std::to_string(k));
            for (int t = 0; t < kNumTiers; ++t)
              for (int kd = 0; kd < kNumMemKinds; ++kd)
                EXPECT_EQ(plan.bytes[t][kd], real.bytes[t][kd]) << "tier " << t << " kind " << kd;
            ASSERT_EQ(plan.buffers.size(), real.buffers.size());
            for (size_t i = 0; i < plan.buffers.size(); ++i) {
              EXPECT_EQ(plan.buffers[i].name, real.buffers[i].name);
              EXPECT_EQ(plan.buffers[i].bytes, real.buffers[i].bytes) << real.buffers[i].name;
            }
            EXPECT_GT(plan.total(), 0);
            // The speculation's own buffer for the new shards (where a unit's master is not
            // its f32 parameters; the nvme tier's never is): the plan counts what the engine
            // holds, above.
            bool twin = false;
            for (const auto& b : plan.buffers) twin |= b.name == "param_speculative";
            const bool aliased = par == Tier::host && dt == DType::f32;
            EXPECT_EQ(twin, k == 2 && par != Tier::nvme &&
                                ((opt == Tier::host && !aliased) || opt == Tier::nvme));
            ++configs;
          }
      }
  EXPECT_EQ(configs, 68);
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
