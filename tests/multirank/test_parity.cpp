// Parity: stages 1, 2 and 3 must give parameters, master weights and optimizer state bitwise
// equal to stage 0 on the same ranks, for every dtype, with and without accumulation. This holds
// by construction (every stage reduces the same shards with the same reduce-scatter, sums the
// norm over the same shard extents in the same chunk order, and updates element-wise with the
// same kernel), so any difference is a bug.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstring>
#include <filesystem>

#include "tests/multirank/harness.hpp"

using namespace zeroshard;
using zs_test::world;

namespace {

struct Case {
  DType dtype;
  int micro;
  OptimizerKind opt;
  StateFormat state = StateFormat::f32;
  Tier tier = Tier::device;  // offload_optimizer
  bool bf16_master = false;
};

std::string case_name(const ::testing::TestParamInfo<Case>& i) {
  std::string name = std::string(dtype_name(i.param.dtype)) + "_k" + std::to_string(i.param.micro) +
                     "_" + optimizer_name(i.param.opt);
  if (i.param.state != StateFormat::f32)
    name += std::string("_state") + state_format_name(i.param.state);
  if (i.param.tier != Tier::device) name += std::string("_") + tier_name(i.param.tier);
  if (i.param.bf16_master) name += "_bf16master";
  return name;
}

Config make_config(const Case& c, int stage) {
  Config cfg;
  cfg.stage = stage;
  cfg.dtype = c.dtype;
  cfg.gradient_accumulation_steps = c.micro;
  cfg.gradient_clipping = 1.0;  // the synthetic gradients' norm is well above 1: clipping engages
  cfg.loss_scale.initial_scale_power = 8;
  cfg.optimizer.kind = c.opt;
  cfg.optimizer.lr = 1e-2f;
  cfg.optimizer.weight_decay = 0.05f;
  if (c.opt == OptimizerKind::sgd) {
    cfg.optimizer.momentum = 0.9f;
    cfg.optimizer.nesterov = true;
  }
  cfg.shard_alignment = 4;  // small grain: shards cut through parameters, as they do in practice
  cfg.collective_timeout_s = 120;
  cfg.optimizer_state = c.state;
  cfg.state_block = 64;  // q8 blocks cut through parameters and groups too
  cfg.offload_optimizer.tier = c.tier;
  cfg.bf16_master = c.bf16_master;
  return cfg;
}

struct Snapshot {
  std::vector<std::vector<float>> param, master, s0, s1;
};

bool bitwise_equal(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), a.size() * 4) == 0);
}

Snapshot run(const Case& c, int stage, void (*adjust)(Config&) = nullptr) {
  Config cfg = make_config(c, stage);
  if (adjust) adjust(cfg);
  Engine e(cfg, world());
  OptimizerOptions bias = e.config().optimizer;
  bias.weight_decay = 0.0f;  // biases excluded from decay, with their own lr
  bias.lr = 2e-2f;
  e.add_group(bias);
  zs_test::register_model(e, zs_test::uneven_model(), 1);
  zs_test::TrainOptions opt;
  opt.micro_batches = c.micro;
  auto results = zs_test::train(e, opt);
  int taken = 0;
  for (auto& r : results) taken += !r.skipped;
  EXPECT_GE(taken, 15) << "most steps must update for the comparison to mean something";
  // The moments are held in their format: bytes per element (q8: plus an f32 per 64).
  int64_t elems = 0;
  for (int u = 0; u < e.num_units(); ++u) {
    const ShardInfo si = e.shard_info(u);
    elems += stage == 0 ? si.padded_numel : si.shard_numel;
    if (c.state == StateFormat::q8) {
      EXPECT_EQ(si.shard_numel % 64, 0);
    }
  }
  const int moments = c.opt == OptimizerKind::sgd || c.opt == OptimizerKind::lion ? 1 : 2;
  const int64_t per = c.state == StateFormat::f32    ? 4 * elems
                      : c.state == StateFormat::bf16 ? 2 * elems
                                                     : elems + elems / 64 * 4;
  EXPECT_EQ(e.memory().at(c.tier, MemKind::optim_state), moments * per);
  if (c.dtype != DType::f32) {  // an f32 model's master is its parameters
    EXPECT_EQ(e.memory().at(c.tier, MemKind::master), (c.bf16_master ? 2 : 4) * elems);
  }
  Snapshot s;
  bool has1 = c.opt == OptimizerKind::adam || c.opt == OptimizerKind::adamw;
  for (int u = 0; u < e.num_units(); ++u) {
    s.param.push_back(e.read_shard(u, StateKind::param));
    s.master.push_back(e.read_shard(u, StateKind::master));
    s.s0.push_back(e.read_shard(u, StateKind::state0));
    s.s1.push_back(has1 ? e.read_shard(u, StateKind::state1) : std::vector<float>{});
    // A bf16 master holds bf16 values, and the parameters are its bits.
    if (c.bf16_master) {
      EXPECT_TRUE(bitwise_equal(s.master.back(), s.param.back())) << "unit " << u;
      for (float v : s.master.back()) EXPECT_EQ(std::bit_cast<uint32_t>(v) & 0xFFFFu, 0u);
    }
  }
  return s;
}

class Parity : public ::testing::TestWithParam<Case> {};

TEST_P(Parity, StagesMatchStageZeroBitwise) {
  const Case c = GetParam();
  Snapshot ref = run(c, 0);
  // The reference must have moved: a do-nothing engine would otherwise pass.
  double moved = 0;
  for (size_t u = 0; u < ref.master.size(); ++u)
    for (float v : ref.s0[u]) moved += std::fabs(v);
  EXPECT_GT(moved, 0.0) << "optimizer state stayed zero";
  for (int stage = 1; stage <= 3; ++stage) {
    Snapshot s = run(c, stage);
    for (size_t u = 0; u < ref.param.size(); ++u) {
      EXPECT_TRUE(bitwise_equal(ref.param[u], s.param[u]))
          << "stage " << stage << " unit " << u << " param";
      EXPECT_TRUE(bitwise_equal(ref.master[u], s.master[u]))
          << "stage " << stage << " unit " << u << " master";
      EXPECT_TRUE(bitwise_equal(ref.s0[u], s.s0[u]))
          << "stage " << stage << " unit " << u << " state0";
      EXPECT_TRUE(bitwise_equal(ref.s1[u], s.s1[u]))
          << "stage " << stage << " unit " << u << " state1";
    }
  }
}

INSTANTIATE_TEST_SUITE_P(AdamW, Parity,
                         ::testing::Values(Case{DType::f32, 1, OptimizerKind::adamw},
                                           Case{DType::bf16, 1, OptimizerKind::adamw},
                                           Case{DType::f16, 1, OptimizerKind::adamw},
                                           Case{DType::f32, 3, OptimizerKind::adamw},
                                           Case{DType::bf16, 3, OptimizerKind::adamw},
                                           Case{DType::f16, 3, OptimizerKind::adamw}),
                         case_name);
INSTANTIATE_TEST_SUITE_P(Others, Parity,
                         ::testing::Values(Case{DType::bf16, 2, OptimizerKind::adam},
                                           Case{DType::bf16, 2, OptimizerKind::sgd},
                                           Case{DType::bf16, 2, OptimizerKind::lion},
                                           Case{DType::f32, 1, OptimizerKind::sgd}),
                         case_name);
// Compact moments: blocks of 64 are global (counted from each unit's element 0, shards padded to
// whole blocks), so every stage quantizes the same blocks as stage 0.
INSTANTIATE_TEST_SUITE_P(
    StateFormats, Parity,
    ::testing::Values(Case{DType::bf16, 1, OptimizerKind::adamw, StateFormat::bf16},
                      Case{DType::bf16, 1, OptimizerKind::adamw, StateFormat::q8},
                      Case{DType::f32, 3, OptimizerKind::adam, StateFormat::q8, Tier::host},
                      Case{DType::bf16, 2, OptimizerKind::lion, StateFormat::q8},
                      Case{DType::bf16, 2, OptimizerKind::sgd, StateFormat::q8, Tier::host}),
    case_name);

// A bf16 master rounds each element with the bits of its index in the unit and of the step, so
// every stage (and shard boundary) rounds alike.
INSTANTIATE_TEST_SUITE_P(
    BF16Master, Parity,
    ::testing::Values(
        Case{DType::bf16, 1, OptimizerKind::adamw, StateFormat::f32, Tier::device, true},
        Case{DType::bf16, 3, OptimizerKind::adamw, StateFormat::q8, Tier::host, true},
        Case{DType::bf16, 2, OptimizerKind::lion, StateFormat::bf16, Tier::device, true},
        Case{DType::bf16, 1, OptimizerKind::sgd, StateFormat::q8, Tier::device, true}),
    case_name);

// Stage 3 with one gather buffer and no prefetch, the least memory a trainer that gathers a
// unit at a time can ask for, takes the same steps.
TEST(ParityOneLiveUnit, Stage3MatchesStageZeroBitwise) {
  const Case c{DType::bf16, 1, OptimizerKind::adamw};
  const Snapshot ref = run(c, 0);
  const Snapshot s = run(c, 3, [](Config& cfg) {
    cfg.max_live_units = 1;
    cfg.prefetch = false;
  });
  for (size_t u = 0; u < ref.param.size(); ++u) {
    EXPECT_TRUE(bitwise_equal(ref.param[u], s.param[u])) << "unit " << u;
    EXPECT_TRUE(bitwise_equal(ref.master[u], s.master[u])) << "unit " << u;
  }
}

// k micro-batches of gradients accumulated by the engine equal one step on their mean.
// Bound: the merged run rounds the mean once to the gradient dtype, the accumulated one rounds
// each micro-gradient and sums in f32. Once a master weight differs, its low-precision copy may
// round the other way, and the gradient (p - target) follows it; so the runs may drift apart by
// one unit in the last place of the parameter dtype at the parameters' magnitude (|p| < 2):
// 2^-7 for bf16, 2^-10 for f16, and a few f32 ulps (1e-6) for f32. Measured worst at 1-4 ranks:
// bf16 5.3e-3, f16 2.6e-4, f32 1.8e-7. A dropped or doubled micro-step moves the mean gradient
// by ~0.5 and the weights by ~0.1 over 20 steps: far outside these bounds.
TEST(Accumulation, MicroBatchesEqualOneLargerBatch) {
  for (DType dt : {DType::f32, DType::bf16, DType::f16}) {
    for (int stage : {0, 3}) {
      Case c{dt, 4, OptimizerKind::adamw};
      Config acc_cfg = make_config(c, stage);
      acc_cfg.gradient_clipping = 0;  // clipping is tested elsewhere; keep the bound simple
      Config one_cfg = acc_cfg;
      one_cfg.gradient_accumulation_steps = 1;
      Engine acc(acc_cfg, world()), one(one_cfg, world());
      zs_test::register_model(acc, zs_test::uneven_model());
      zs_test::register_model(one, zs_test::uneven_model());
      zs_test::TrainOptions o;
      o.micro_batches = 4;
      zs_test::train(acc, o);
      o.merge_micro = true;
      zs_test::train(one, o);
      const double bound = dt == DType::f32 ? 1e-6 : dt == DType::f16 ? 0x1p-10 : 0x1p-7;
      double worst = 0, moved = 0;
      for (int u = 0; u < acc.num_units(); ++u) {
        auto a = acc.read_shard(u, StateKind::master), b = one.read_shard(u, StateKind::master);
        auto init = acc.read_shard(u, StateKind::state0);
        for (size_t i = 0; i < a.size(); ++i)
          worst = std::max(worst, double(std::fabs(a[i] - b[i])));
        for (float v : init) moved += std::fabs(v);
      }
      EXPECT_GT(moved, 0.0);
      EXPECT_LE(worst, bound) << dtype_name(dt) << " stage " << stage;
    }
  }
}

// One parameter whole (DeepSpeed's safe_get_full_fp32_param and its kin): the same bits at every
// stage, and a write of one parameter's master weights changes that parameter only (its
// low-precision copy rounded from it), on every rank.
TEST(RestoreFull, OneParameterWholeAtEveryStage) {
  const Case c{DType::bf16, 1, OptimizerKind::adamw};
  const StateKind kinds[] = {StateKind::master, StateKind::state0, StateKind::state1,
                             StateKind::param};
  std::vector<std::vector<float>> ref;
  for (int stage = 0; stage <= 3; ++stage) {
    Engine e(make_config(c, stage), world());
    zs_test::register_model(e, zs_test::uneven_model());
    zs_test::TrainOptions opt;
    opt.steps = 3;
    zs_test::train(e, opt);
    std::vector<std::vector<float>> got;
    for (int u = 0; u < e.num_units(); ++u) {
      const std::vector<Param> ps = e.unit_params(u);
      for (int p = 0; p < int(ps.size()); ++p)
        for (StateKind k : kinds) {
          got.push_back(e.read_full(u, p, k));
          EXPECT_EQ(int64_t(got.back().size()), shape_numel(ps[size_t(p)].shape));
        }
    }
    if (stage == 0) {
      ref = got;
      double moved = 0;
      for (float x : got[1]) moved += std::fabs(x);  // embed.w's first moment
      EXPECT_GT(moved, 0.0);
    } else {
      for (size_t i = 0; i < got.size(); ++i)
        EXPECT_TRUE(bitwise_equal(ref[i], got[i])) << "stage " << stage << " entry " << i;
    }
    // layer1.gain is unit 2's parameter 2; its neighbour layer1.b is parameter 1.
    std::vector<float> v(13);
    for (size_t i = 0; i < v.size(); ++i) v[i] = 0.125f * float(i) - 0.5f;  // exact in bf16
    const std::vector<float> b_before = e.read_full(2, 1, StateKind::master);
    e.write_full(2, 2, StateKind::master, v);
    EXPECT_TRUE(bitwise_equal(e.read_full(2, 2, StateKind::master), v)) << "stage " << stage;
    EXPECT_TRUE(bitwise_equal(e.read_full(2, 2, StateKind::param), v)) << "stage " << stage;
    EXPECT_TRUE(bitwise_equal(e.read_full(2, 1, StateKind::master), b_before));
    std::vector<float> m(13, 0.0f);
    e.write_full(2, 2, StateKind::state0, m);
    EXPECT_TRUE(bitwise_equal(e.read_full(2, 2, StateKind::state0), m));
    EXPECT_ZS_ERROR(e.read_full(2, 3, StateKind::master), invalid_argument, "no parameter 3");
    EXPECT_ZS_ERROR(e.write_full(2, 2, StateKind::master, std::vector<float>(12)), invalid_argument,
                    "has 13 elements, got 12");
    if (world()->size() > 1) {
      std::vector<float> w = v;
      if (world()->rank() == 0) w[3] = 7.0f;
      EXPECT_ZS_ERROR(e.write_full(2, 2, StateKind::master, w), invalid_argument,
                      "the ranks passed different values");
    }
  }
}

}  // namespace

// A sharded state written back into a fresh engine continues bitwise like the original.
// With compact moments too: read_shard() widens them to f32, write_shard() narrows them back to
// the same bits (q8: the same codes and absmax).
TEST(Restore, WriteShardCommitContinuesIdentically) {
  for (int stage = 0; stage <= 3; ++stage)
    for (StateFormat f : {StateFormat::f32, StateFormat::bf16, StateFormat::q8}) {
      Case c{DType::bf16, 1, OptimizerKind::adamw, f};
      Engine a(make_config(c, stage), world()), b(make_config(c, stage), world());
      zs_test::register_model(a, zs_test::uneven_model());
      zs_test::register_model(b, zs_test::uneven_model());
      zs_test::TrainOptions o;
      o.steps = 5;
      zs_test::train(a, o);
      for (int u = 0; u < a.num_units(); ++u)
        for (StateKind k : {StateKind::master, StateKind::state0, StateKind::state1})
          b.write_shard(u, k, a.read_shard(u, k));
      b.commit_shards();
      b.set_step_count(a.step_count());
      b.set_loss_scale(a.loss_scale());
      zs_test::train(a, o);
      zs_test::train(b, o);
      for (int u = 0; u < a.num_units(); ++u)
        for (StateKind k :
             {StateKind::param, StateKind::master, StateKind::state0, StateKind::state1})
          EXPECT_TRUE(bitwise_equal(a.read_shard(u, k), b.read_shard(u, k)))
              << "stage " << stage << " unit " << u << " " << state_format_name(f);
      // Without the restore the fresh engine would differ (the check can fail).
      EXPECT_GT(a.step_count(), 5);
    }
}

// Stage 3 prefetch across a step: a unit prefetched during one step's gathers must not be handed
// out with the parameters from before the update.
TEST(Restore, PrefetchedUnitIsFreshAfterStep) {
  Config cfg;
  cfg.stage = 3;
  cfg.optimizer.kind = OptimizerKind::sgd;
  cfg.optimizer.lr = 0.1f;
  cfg.optimizer.weight_decay = 0;
  Engine e(cfg, world());
  std::vector<float> zeros(4, 0.0f);
  e.add_unit("A", {Param{"a", {4}, 0, {zeros.data(), 4}}});
  e.add_unit("B", {Param{"b", {4}, 0, {zeros.data(), 4}}});
  e.finalize();
  auto visit = [&](std::vector<int> order) {
    for (int u : order) {
      e.gather(u);
      e.release(u);
    }
  };
  std::vector<float> ones(4, 1.0f);
  auto step = [&] {
    for (int u : {0, 1}) e.grads_ready(u, {{ones.data(), 4, DType::f32}});
    e.step();
  };
  visit({0, 1, 0});
  step();         // records the order A, B, A
  visit({0, 1});  // gather(B) prefetches A
  step();         // updates A's shard: the prefetch is stale
  auto a = e.gather(0);
  EXPECT_FLOAT_EQ(a[0].as<float>()[0], -0.2f) << "two SGD steps of lr 0.1 on gradient 1";
  e.release(0);
}

// The reduced gradient of one parameter whole (DeepSpeed's safe_get_full_grad), read between
// the last micro-step and step(): the mean over the ranks and micro-steps of what each rank
// handed over, the same bits at every stage and tier, and the step that follows unchanged by the
// read (it closes the micro-steps as clip_grad_norm() does).
TEST(RestoreFull, GradientWholeIsTheMeanOverRanksAndMicroSteps) {
  struct Where {
    int stage;
    Tier tier;
  };
  const Where places[] = {{0, Tier::device}, {1, Tier::device}, {2, Tier::host},
                          {3, Tier::device}, {2, Tier::nvme},   {3, Tier::nvme}};
  const int k = 2, W = world()->size();
  std::vector<std::vector<float>> ref_grads, ref_master;
  {  // the same steps without the read: what every run with it must end at
    Engine plain(make_config(Case{DType::f32, k, OptimizerKind::adamw}, 0), world());
    zs_test::register_model(plain, zs_test::uneven_model());
    zs_test::TrainOptions opt;
    opt.steps = 3;
    opt.micro_batches = k;
    zs_test::train(plain, opt);
    for (int u = 0; u < plain.num_units(); ++u)
      ref_master.push_back(plain.read_shard(u, StateKind::master));
  }
  for (const Where& w : places) {
    Config cfg =
        make_config(Case{DType::f32, k, OptimizerKind::adamw, StateFormat::f32, w.tier}, w.stage);
    if (w.tier == Tier::nvme) {
      const auto root = std::filesystem::temp_directory_path() / "zeroshard-fullgrad-tests";
      std::filesystem::create_directories(root);
      cfg.offload_optimizer.nvme_paths = {root.string()};
      cfg.aio.block_size = 4096;
    }
    Engine e(cfg, world());
    zs_test::register_model(e, zs_test::uneven_model());
    std::vector<std::vector<float>> grads;
    double worst = 0, largest = 0;
    zs_test::TrainOptions opt;
    opt.steps = 3;
    opt.micro_batches = k;
    opt.before_step = [&](Engine& en) {
      if (en.step_count() != 1) return;  // the second step's gradients
      for (int u = 0; u < en.num_units(); ++u) {
        const std::vector<Param> ps = en.unit_params(u);
        int64_t flat = 0;
        for (int p = 0; p < int(ps.size()); ++p) {
          const std::vector<float> pv = en.read_full(u, p, StateKind::param);
          grads.push_back(en.read_full_grad(u, p));
          ASSERT_EQ(grads.back().size(), pv.size());
          for (size_t i = 0; i < pv.size(); ++i, ++flat) {
            double want = 0;
            for (int r = 0; r < W; ++r)
              for (int m = 0; m < k; ++m) want += zs_test::synthetic_grad(pv[i], u, flat, r, m, 1);
            want /= double(W * k);
            worst = std::max(worst, std::fabs(double(grads.back()[i]) - want));
            largest = std::max(largest, std::fabs(want));
          }
        }
      }
    };
    zs_test::train(e, opt);
    ASSERT_FALSE(grads.empty());
    EXPECT_GT(largest, 0.1);
    EXPECT_LT(worst, 1e-6) << "stage " << w.stage << " " << tier_name(w.tier);
    std::vector<std::vector<float>> master;
    for (int u = 0; u < e.num_units(); ++u) master.push_back(e.read_shard(u, StateKind::master));
    for (size_t i = 0; i < grads.size() && !ref_grads.empty(); ++i)
      EXPECT_TRUE(bitwise_equal(ref_grads[i], grads[i]))
          << "stage " << w.stage << " " << tier_name(w.tier) << " parameter " << i;
    if (ref_grads.empty()) ref_grads = grads;
    for (size_t u = 0; u < master.size(); ++u)
      EXPECT_TRUE(bitwise_equal(ref_master[u], master[u]))
          << "stage " << w.stage << " " << tier_name(w.tier) << " unit " << u;
  }
}
