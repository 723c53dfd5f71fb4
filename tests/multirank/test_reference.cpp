// Stage 0 against an independent scalar fp64 implementation of AdamW (two parameter groups,
// f32 parameters, averaged over all ranks' gradients).
//
// Bound: both runs follow the same formulas; they differ by f32 rounding (about 6e-8 relative per
// operation) and by the gradient being computed from f32 rather than f64 parameters. Adam's
// normalised update turns a relative gradient error δ into an update error of about lr·δ, except
// where the gradient is near zero and m/√v is ill-conditioned; 20 steps at lr 1e-2 then stay well
// below 2e-5 on parameters of magnitude ≤ 1 (measured worst: see the printed value).
#include <gtest/gtest.h>

#include <cmath>

#include "tests/multirank/harness.hpp"

using namespace zeroshard;
using zs_test::world;

TEST(Reference, StageZeroMatchesFp64AdamW) {
  Config cfg;
  cfg.stage = 0;
  cfg.optimizer.kind = OptimizerKind::adamw;
  cfg.optimizer.lr = 1e-2f;
  cfg.optimizer.weight_decay = 0.1f;
  Engine e(cfg, world());
  OptimizerOptions bias = cfg.optimizer;
  bias.weight_decay = 0;
  bias.lr = 3e-2f;
  e.add_group(bias);
  auto model = zs_test::uneven_model();
  zs_test::register_model(e, model, 1);
  zs_test::TrainOptions opt;
  opt.steps = 20;
  zs_test::train(e, opt);

  const int world_size = e.world_size();
  double worst = 0, moved = 0;
  for (size_t u = 0; u < model.size(); ++u) {
    // Reference state for the whole unit, in double.
    std::vector<double> p, m, v;
    std::vector<int> grp;
    for (const auto& [name, shape] : model[u].params) {
      auto init = zs_test::init_values(model[u].name, name, shape_numel(shape));
      p.insert(p.end(), init.begin(), init.end());
      grp.insert(grp.end(), init.size(), name[0] == 'b' ? 1 : 0);
    }
    m.assign(p.size(), 0);
    v.assign(p.size(), 0);
    std::vector<double> p0 = p;
    for (int t = 1; t <= opt.steps; ++t) {
      for (size_t i = 0; i < p.size(); ++i) {
        double g = 0;
        for (int r = 0; r < world_size; ++r)
          g += zs_test::synthetic_grad(float(p[i]), int(u), int64_t(i), r, 0, t - 1);
        g /= world_size;
        const OptimizerOptions& o = grp[i] ? bias : cfg.optimizer;
        double lr = o.lr, b1 = o.beta1, b2 = o.beta2;
        p[i] -= lr * o.weight_decay * p[i];
        m[i] = b1 * m[i] + (1 - b1) * g;
        v[i] = b2 * v[i] + (1 - b2) * g * g;
        double mh = m[i] / (1 - std::pow(b1, t)), vh = v[i] / (1 - std::pow(b2, t));
        p[i] -= lr * mh / (std::sqrt(vh) + o.eps);
      }
    }
    ShardInfo si = e.shard_info(int(u));
    auto got = e.read_shard(int(u), StateKind::master);
    for (int64_t j = 0; j < si.shard_numel; ++j) {
      int64_t i = si.shard_offset + j;
      if (i >= si.numel) {
        EXPECT_EQ(got[size_t(j)], 0.0f) << "padding must stay zero";
        continue;
      }
      worst = std::max(worst, std::fabs(got[size_t(j)] - p[size_t(i)]));
      moved = std::max(moved, std::fabs(p[size_t(i)] - p0[size_t(i)]));
    }
  }
  printf("stage 0 vs fp64 AdamW: worst |difference| = %.3g, largest move = %.3g\n", worst, moved);
  EXPECT_GT(moved, 0.05) << "the reference must move the parameters for the comparison to bite";
  EXPECT_LE(worst, 2e-5);
}
