// Loss scaling and clipping across ranks.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <string>

#include "tests/multirank/harness.hpp"

using namespace zeroshard;
using zs_test::world;

namespace {

Config f16_config(int stage, int hysteresis, int window) {
  Config cfg;
  cfg.stage = stage;
  cfg.dtype = DType::f16;
  cfg.loss_scale.initial_scale_power = 10;
  cfg.loss_scale.hysteresis = hysteresis;
  cfg.loss_scale.window = window;
  cfg.optimizer.lr = 1e-2f;
  return cfg;
}

// Plain SGD (lr 1, no momentum, no decay): each master weight moves by exactly the update's
// gradient, which the tests below compute here in double.
Config sgd_config(int stage) {
  Config cfg;
  cfg.stage = stage;
  cfg.optimizer.kind = OptimizerKind::sgd;
  cfg.optimizer.lr = 1.0f;
  cfg.optimizer.weight_decay = 0;
  return cfg;
}

// The initial values of unit u of `model`, flattened as the engine lays them out.
std::vector<float> unit_init(const std::vector<zs_test::UnitSpec>& model, size_t u) {
  std::vector<float> init;
  for (const auto& [name, shape] : model[u].params) {
    auto v = zs_test::init_values(model[u].name, name, shape_numel(shape));
    init.insert(init.end(), v.begin(), v.end());
  }
  return init;
}

std::vector<std::vector<float>> masters(Engine& e) {
  std::vector<std::vector<float>> out;
  for (int u = 0; u < e.num_units(); ++u) out.push_back(e.read_shard(u, StateKind::master));
  return out;
}

// An inf written by the last rank into one gradient skips the step on every rank, leaves every
// shard untouched, and halves the scale (hysteresis 1); clean steps then grow it again.
TEST(LossScale, InfOnOneRankSkipsEverywhereAndHalves) {
  for (int stage : {0, 2, 3}) {
    Engine e(f16_config(stage, 1, 2), world());
    zs_test::register_model(e, zs_test::uneven_model());
    zs_test::TrainOptions clean;
    clean.steps = 1;
    zs_test::train(e, clean);  // one clean step (iteration 0)
    const float scale0 = e.loss_scale();
    const int64_t steps0 = e.step_count();
    auto before = masters(e);

    zs_test::TrainOptions bad;
    bad.steps = 1;
    const int culprit = e.world_size() - 1;
    bad.tamper = [&](Engine& eng, int u, int, int64_t, std::vector<TensorView>& g) {
      if (eng.rank() == culprit && u == 2)
        zs_test::store(g[1].data, g[1].dtype, 3, std::numeric_limits<float>::infinity());
    };
    auto r = zs_test::train(e, bad);
    EXPECT_TRUE(r[0].skipped) << "stage " << stage;
    EXPECT_EQ(e.step_count(), steps0);
    EXPECT_EQ(e.loss_scale(), scale0 / 2) << "stage " << stage;
    auto after = masters(e);
    for (size_t u = 0; u < before.size(); ++u)
      EXPECT_EQ(std::memcmp(before[u].data(), after[u].data(), before[u].size() * 4), 0)
          << "unit " << u;

    auto rr = zs_test::train(e, clean);  // window 2 after the overflow: iteration 2 is clean
    EXPECT_FALSE(rr[0].skipped);
    zs_test::train(e, clean);
    EXPECT_EQ(e.loss_scale(), scale0 / 2) << "the step after the overflow does not count";
    zs_test::train(e, clean);
    EXPECT_EQ(e.loss_scale(), scale0) << "two clean steps after the one after the overflow "
                                         "double the scale back (DeepSpeed >= 0.17.1)";
    EXPECT_EQ(e.step_count(), steps0 + 3);
  }
}

TEST(LossScale, HysteresisToleratesOneOverflow) {
  Engine e(f16_config(1, 2, 1000), world());
  zs_test::register_model(e, zs_test::uneven_model());
  const float s0 = e.loss_scale();
  zs_test::TrainOptions bad;
  bad.steps = 1;
  bad.tamper = [](Engine&, int u, int, int64_t, std::vector<TensorView>& g) {
    if (u == 0) zs_test::store(g[0].data, g[0].dtype, 0, std::numeric_limits<float>::quiet_NaN());
  };
  EXPECT_TRUE(zs_test::train(e, bad)[0].skipped);
  EXPECT_EQ(e.loss_scale(), s0);
  EXPECT_TRUE(zs_test::train(e, bad)[0].skipped);
  EXPECT_EQ(e.loss_scale(), s0 / 2);
}

// fp16.consecutive_hysteresis (DeepSpeed's meaning): a clean step refills the hysteresis, so
// only overflows in a row halve the scale.
TEST(LossScale, ConsecutiveHysteresisRefillsOnACleanStep) {
  for (bool consecutive : {false, true}) {
    Config cfg = f16_config(1, 2, 1000);
    cfg.loss_scale.consecutive_hysteresis = consecutive;
    Engine e(cfg, world());
    zs_test::register_model(e, zs_test::uneven_model());
    const float s0 = e.loss_scale();
    zs_test::TrainOptions bad, clean;
    bad.steps = clean.steps = 1;
    bad.tamper = [](Engine&, int u, int, int64_t, std::vector<TensorView>& g) {
      if (u == 0) zs_test::store(g[0].data, g[0].dtype, 0, std::numeric_limits<float>::infinity());
    };
    EXPECT_TRUE(zs_test::train(e, bad)[0].skipped);  // tolerated either way
    EXPECT_FALSE(zs_test::train(e, clean)[0].skipped);
    EXPECT_TRUE(zs_test::train(e, bad)[0].skipped);
    EXPECT_EQ(e.loss_scale(), consecutive ? s0 : s0 / 2) << "consecutive " << consecutive;
  }
}

// At the minimum loss scale an overflow cannot be absorbed any more: instead of skipping every
// step from then on in silence (as DeepSpeed does), step() fails on every rank, after
// the hysteresis has been used up, and applies nothing.
TEST(LossScale, OverflowAtTheMinimumScaleFailsEveryRank) {
  Config cfg = f16_config(2, 2, 1000);
  cfg.loss_scale.initial_scale_power = 1;  // 2: one halving reaches the minimum
  cfg.loss_scale.min_scale = 1;
  Engine e(cfg, world());
  zs_test::register_model(e, zs_test::uneven_model());
  zs_test::TrainOptions bad;
  bad.steps = 1;
  const int culprit = e.world_size() - 1;
  bad.tamper = [&](Engine& eng, int u, int, int64_t, std::vector<TensorView>& g) {
    if (eng.rank() == culprit && u == 1)
      zs_test::store(g[0].data, g[0].dtype, 0, std::numeric_limits<float>::infinity());
  };
  EXPECT_TRUE(zs_test::train(e, bad)[0].skipped);  // hysteresis 2: tolerated
  EXPECT_EQ(e.loss_scale(), 2.0f);
  EXPECT_TRUE(zs_test::train(e, bad)[0].skipped);  // halved to the minimum
  EXPECT_EQ(e.loss_scale(), 1.0f);
  auto before = masters(e);
  EXPECT_ZS_ERROR(zs_test::train(e, bad), overflow,
                  "overflowed with the loss scale already at its minimum (1, "
                  "fp16.min_loss_scale = 1)");
  auto after = masters(e);
  for (size_t u = 0; u < before.size(); ++u)
    EXPECT_EQ(std::memcmp(before[u].data(), after[u].data(), before[u].size() * 4), 0);
  // Clean steps go on from there.
  zs_test::TrainOptions clean;
  clean.steps = 1;
  EXPECT_FALSE(zs_test::train(e, clean)[0].skipped);
}

// Clipping: the reported norm equals the norm of the averaged gradients computed here in double,
// and SGD (lr 1, no momentum, no decay) moves each parameter by exactly -clip_factor × gradient.
TEST(Clipping, NormAndFactorMatchReference) {
  for (int stage : {0, 1, 3}) {
    Config cfg = sgd_config(stage);
    cfg.gradient_clipping = 0.5;
    Engine e(cfg, world());
    auto model = zs_test::uneven_model();
    zs_test::register_model(e, model);
    const std::vector<std::vector<float>> p0 = masters(e);
    zs_test::TrainOptions o;
    o.steps = 1;
    StepResult r = zs_test::train(e, o)[0];

    double sumsq = 0;
    std::vector<std::vector<double>> gavg;
    for (size_t u = 0; u < model.size(); ++u) {
      const std::vector<float> init = unit_init(model, u);
      std::vector<double> g(init.size());
      for (size_t i = 0; i < init.size(); ++i) {
        for (int rk = 0; rk < e.world_size(); ++rk)
          g[i] += zs_test::synthetic_grad(init[i], int(u), int64_t(i), rk, 0, 0);
        g[i] /= e.world_size();
        sumsq += g[i] * g[i];
      }
      gavg.push_back(g);
    }
    const double norm = std::sqrt(sumsq);
    ASSERT_GT(norm, 0.5) << "the test needs clipping to engage";
    EXPECT_NEAR(r.grad_norm, norm, 1e-5 * norm) << "stage " << stage;
    const double factor = 0.5 / (norm + 1e-6);
    EXPECT_NEAR(r.clip_factor, factor, 1e-6 * factor);
    for (int u = 0; u < e.num_units(); ++u) {
      ShardInfo si = e.shard_info(u);
      auto p1 = e.read_shard(u, StateKind::master);
      for (int64_t j = 0; j < si.shard_numel && si.shard_offset + j < si.numel; ++j) {
        double step = double(p0[size_t(u)][size_t(j)]) - p1[size_t(j)];
        EXPECT_NEAR(step, factor * gavg[size_t(u)][size_t(si.shard_offset + j)], 1e-6)
            << "unit " << u << " elem " << j;
      }
    }
  }
}

// The norm is taken from each unit's final gradient as it arrives (inside the pass that folds the
// last micro-step, when accumulating), not in step(). It must still be the norm of the mean over
// every micro-step and rank, and bitwise the same at every stage and on the device and host
// tiers: a unit of several 64 Ki-element chunks per shard makes stage 0 (which sums its own
// elements inside the whole gradient) chunk exactly as the sharded stages do.
TEST(Clipping, NormOfAccumulatedGradientsIsExactEverywhere) {
  const int k = 3, steps = 2;
  auto model = zs_test::uneven_model();
  model.push_back({"wide", {{"w", {600, 701}}, {"b", {701}}}});
  // lr 0: the parameters stay at their initial values, so every step's reference is computed
  // from them, and a sum left over from the step before would show.
  std::vector<double> norm(steps);
  for (int st = 0; st < steps; ++st) {
    double sumsq = 0;
    for (size_t u = 0; u < model.size(); ++u) {
      const std::vector<float> init = unit_init(model, u);
      for (size_t i = 0; i < init.size(); ++i) {
        double g = 0;
        for (int rk = 0; rk < world()->size(); ++rk)
          for (int m = 0; m < k; ++m)
            g += zs_test::synthetic_grad(init[i], int(u), int64_t(i), rk, m, st);
        g /= world()->size() * k;
        sumsq += g * g;
      }
    }
    norm[size_t(st)] = std::sqrt(sumsq);
  }
  std::vector<StepResult> first;
  for (int stage : {0, 1, 2, 3})
    for (Tier tier : {Tier::device, Tier::host}) {
      Config cfg = sgd_config(stage);
      cfg.dtype = DType::f32;
      cfg.optimizer.lr = 0;
      cfg.gradient_accumulation_steps = k;
      cfg.offload_optimizer.tier = tier;
      Engine e(cfg, world());
      zs_test::register_model(e, model);
      zs_test::TrainOptions o;
      o.steps = steps;
      o.micro_batches = k;
      const std::vector<StepResult> r = zs_test::train(e, o);
      if (first.empty()) first = r;
      for (int st = 0; st < steps; ++st) {
        const std::string where = "stage " + std::to_string(stage) + ", " + tier_name(tier) +
                                  ", step " + std::to_string(st);
        const double got = r[size_t(st)].grad_norm;
        EXPECT_NEAR(got, norm[size_t(st)], 1e-6 * norm[size_t(st)]) << where;
        EXPECT_EQ(got, first[size_t(st)].grad_norm)
            << where << ": not bitwise the norm of stage 0 on the device tier";
      }
    }
}

// The copying grads_ready(unit, grads) zeroes only the padding after the parameters it copies:
// a staging slot that held a larger unit before must still reduce zeros there. Its norms and
// masters equal those of grads() filled in place, bitwise.
TEST(Clipping, CopyingHandOverMatchesTheInPlaceOne) {
  for (int stage : {1, 2, 3}) {
    std::vector<StepResult> r[2];
    std::vector<std::vector<float>> m[2];
    for (int copying : {0, 1}) {
      Config cfg = sgd_config(stage);
      cfg.gradient_clipping = 0.5;
      Engine e(cfg, world());
      zs_test::register_model(e, zs_test::uneven_model());
      zs_test::TrainOptions o;
      o.steps = 3;
      if (copying)  // the harness then writes gradients on the host and hands them over copied
        o.download = [](void* host, const void* dev, size_t bytes) {
          std::memcpy(host, dev, bytes);
        };
      r[copying] = zs_test::train(e, o);
      m[copying] = masters(e);
    }
    for (size_t s = 0; s < r[0].size(); ++s)
      EXPECT_EQ(r[0][s].grad_norm, r[1][s].grad_norm) << "stage " << stage << " step " << s;
    EXPECT_TRUE(m[0] == m[1]) << "stage " << stage;
  }
}

// clip_grad_norm() before step() (torch.nn.utils.clip_grad_norm_'s place in a loop) returns the
// norm step() reports and trains bitwise like Config::gradient_clipping, also when called again
// with looser thresholds; it closes the step's gradients (a further hand-over is refused) until
// step() or zero_grad().
TEST(Clipping, ClipGradNormBeforeStepActsLikeTheConfig) {
  for (int stage : {0, 2, 3}) {
    Config a = sgd_config(stage), b = a;
    a.gradient_clipping = 0.5;
    a.gradient_accumulation_steps = b.gradient_accumulation_steps = 2;
    Engine ea(a, world()), eb(b, world());
    zs_test::register_model(ea, zs_test::uneven_model());
    zs_test::register_model(eb, zs_test::uneven_model());
    zs_test::TrainOptions o;
    o.steps = 3;
    o.micro_batches = 2;
    const std::vector<StepResult> ra = zs_test::train(ea, o);
    std::vector<double> norms;
    o.before_step = [&](Engine& e) {
      norms.push_back(e.clip_grad_norm(0.5));
      // A second call reuses the reduction, and neither a looser threshold nor 0 undoes the
      // first one's (clipping twice clips at the smaller).
      EXPECT_EQ(e.clip_grad_norm(50.0), norms.back()) << "a second call reuses the reduction";
      EXPECT_EQ(e.clip_grad_norm(0.0), norms.back());
      EXPECT_THROW(e.grads(0), Error) << "gradients after clip_grad_norm()";
    };
    const std::vector<StepResult> rb = zs_test::train(eb, o);
    for (size_t s = 0; s < ra.size(); ++s) {
      EXPECT_LT(ra[s].clip_factor, 1.0) << "the test needs clipping to engage";
      EXPECT_EQ(rb[s].clip_factor, ra[s].clip_factor) << "stage " << stage << " step " << s;
      EXPECT_EQ(norms[s], rb[s].grad_norm);
    }
    for (int u = 0; u < ea.num_units(); ++u) {
      const auto x = ea.read_shard(u, StateKind::master), y = eb.read_shard(u, StateKind::master);
      EXPECT_EQ(std::memcmp(x.data(), y.data(), x.size() * 4), 0) << "unit " << u;
    }
    // Without a call, the next step does not clip; zero_grad() forgets a closed step.
    o.before_step = [](Engine& e) {
      e.clip_grad_norm(0.5);
      e.zero_grad();
    };
    o.steps = 1;
    EXPECT_THROW(zs_test::train(eb, o), Error) << "step() after zero_grad() has no gradients";
    o.before_step = nullptr;
    EXPECT_EQ(zs_test::train(eb, o)[0].clip_factor, 1.0);
    EXPECT_THROW(eb.clip_grad_norm(-1), Error);
  }
}

// The accumulated gradient is the mean over micro-steps and ranks, not their sum: with SGD (lr 1,
// no momentum, no decay, no clipping), which unlike Adam is not invariant to the gradient's
// scale, each master weight moves by exactly that mean.
TEST(Accumulation, UpdateIsTheMeanOverMicroStepsAndRanks) {
  const int k = 3;
  for (int stage : {0, 2, 3}) {
    Config cfg = sgd_config(stage);
    cfg.gradient_accumulation_steps = k;
    Engine e(cfg, world());
    auto model = zs_test::uneven_model();
    zs_test::register_model(e, model);
    const std::vector<std::vector<float>> p0 = masters(e);
    zs_test::TrainOptions o;
    o.steps = 1;
    o.micro_batches = k;
    EXPECT_FALSE(zs_test::train(e, o)[0].skipped);
    for (size_t u = 0; u < model.size(); ++u) {
      const std::vector<float> init = unit_init(model, u);
      const ShardInfo si = e.shard_info(int(u));
      const auto p1 = e.read_shard(int(u), StateKind::master);
      for (int64_t j = 0; j < si.shard_numel && si.shard_offset + j < si.numel; ++j) {
        const size_t i = size_t(si.shard_offset + j);
        double mean = 0;
        for (int rk = 0; rk < e.world_size(); ++rk)
          for (int m = 0; m < k; ++m)
            mean += zs_test::synthetic_grad(init[i], int(u), int64_t(i), rk, m, 0);
        mean /= double(k * e.world_size());
        EXPECT_NEAR(double(p0[u][size_t(j)]) - p1[size_t(j)], mean, 1e-5)
            << "stage " << stage << " unit " << u << " element " << i;
      }
    }
  }
}

// set_options() (what schedulers that cycle betas or momentum need): an engine whose group
// changes its hyperparameters before the first step trains bitwise like one built with them;
// an SGD momentum that would turn its buffer on after finalize() is refused.
TEST(Accumulation, SetOptionsActsLikeConstructionWithThem) {
  Config a = f16_config(2, 2, 1000), b = a;
  a.dtype = b.dtype = DType::bf16;
  b.optimizer.beta1 = 0.8f;
  b.optimizer.weight_decay = 0.2f;
  Engine ea(a, world()), eb(b, world());
  zs_test::register_model(ea, zs_test::uneven_model());
  zs_test::register_model(eb, zs_test::uneven_model());
  ea.set_options(0, b.optimizer);
  EXPECT_EQ(ea.options(0).beta1, 0.8f);
  zs_test::TrainOptions o;
  o.steps = 4;
  zs_test::train(ea, o);
  zs_test::train(eb, o);
  for (int u = 0; u < ea.num_units(); ++u)
    for (StateKind k :
         {StateKind::param, StateKind::master, StateKind::state0, StateKind::state1}) {
      const auto x = ea.read_shard(u, k), y = eb.read_shard(u, k);
      EXPECT_EQ(std::memcmp(x.data(), y.data(), x.size() * 4), 0) << "unit " << u;
    }
  OptimizerOptions bad = b.optimizer;
  bad.beta1 = 1.5f;
  EXPECT_ZS_ERROR(ea.set_options(0, bad), invalid_config, "beta");
  bad = b.optimizer;
  bad.kind = OptimizerKind::lion;
  EXPECT_ZS_ERROR(ea.set_options(0, bad), invalid_argument, "differs from the engine's");

  Config sgd = sgd_config(1);
  Engine es(sgd, world());
  zs_test::register_model(es, zs_test::uneven_model());
  OptimizerOptions m = sgd.optimizer;
  m.momentum = 0.9f;
  EXPECT_ZS_ERROR(es.set_options(0, m), invalid_argument, "turns the momentum buffer on or off");
}

}  // namespace
