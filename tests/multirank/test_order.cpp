// The order of the collectives belongs to the engine, not to the trainer. Ranks that hand units
// over in different orders (hooks that fire in another order, a branch or a head used on some
// ranks only) reduce the same units in the same collectives, bitwise as if they all went in one
// order. What the engine cannot reorder, stage 3's gathers, is compared across ranks at step():
// a mix-up fails every rank, naming the collective and the units, before anything is applied.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <random>

#include "tests/multirank/harness.hpp"

using namespace zeroshard;
using zs_test::world;

namespace {

using Order = std::function<std::vector<int>(int, int64_t, int, int)>;

Config make_config(int stage, DType dt, int micro) {
  Config cfg;
  cfg.stage = stage;
  cfg.dtype = dt;
  cfg.gradient_accumulation_steps = micro;
  cfg.gradient_clipping = 1.0;
  cfg.loss_scale.initial_scale_power = 8;
  cfg.optimizer.lr = 1e-2f;
  cfg.shard_alignment = 4;
  cfg.collective_timeout_s = 120;
  return cfg;
}

// Every state of every unit after a few steps in the given order.
std::vector<std::vector<float>> run(int stage, DType dt, int micro, const Order& order) {
  Engine e(make_config(stage, dt, micro), world());
  zs_test::register_model(e, zs_test::uneven_model());
  zs_test::TrainOptions opt;
  opt.steps = 6;
  opt.micro_batches = micro;
  opt.order = order;
  for (const StepResult& r : zs_test::train(e, opt)) EXPECT_FALSE(r.skipped);
  std::vector<std::vector<float>> out;
  for (int u = 0; u < e.num_units(); ++u)
    for (StateKind k : {StateKind::param, StateKind::master, StateKind::state0, StateKind::state1})
      out.push_back(e.read_shard(u, k));
  return out;
}

// A shuffle seeded by (rank, step, micro-step): every rank its own order, every micro-step anew.
std::vector<int> per_rank(int rank, int64_t step, int micro, int n) {
  std::vector<int> o(static_cast<size_t>(n));
  std::iota(o.begin(), o.end(), 0);
  std::mt19937 g(uint32_t(1000 * rank + 10 * step + micro));
  std::shuffle(o.begin(), o.end(), g);
  return o;
}

// The same shuffle on every rank (stage 3 gathers in the trainer's order, which must agree).
std::vector<int> shared(int, int64_t step, int micro, int n) {
  return per_rank(0, step, micro, n);
}

bool bitwise_equal(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), a.size() * 4) == 0);
}

}  // namespace

// Without the engine's order, ranks in different orders reduce different units in one
// collective: units of different sizes fail inside MPI, equal ones are averaged with each other.
TEST(Order, RanksInTheirOwnOrderMatchOneOrderBitwise) {
  for (int stage = 0; stage <= 3; ++stage) {
    for (DType dt : {DType::f32, DType::bf16}) {
      for (int micro : {1, 2}) {
        SCOPED_TRACE("stage " + std::to_string(stage) + " " + dtype_name(dt) + " k " +
                     std::to_string(micro));
        const auto ref = run(stage, dt, micro, nullptr);
        const auto mixed = run(stage, dt, micro, stage == 3 ? Order(shared) : Order(per_rank));
        double moved = 0;
        for (size_t i = 2; i < ref.size(); i += 4)  // state0: Adam's first moment
          for (float v : ref[i]) moved += std::fabs(v);
        EXPECT_GT(moved, 0.0);
        ASSERT_EQ(ref.size(), mixed.size());
        for (size_t i = 0; i < ref.size(); ++i)
          EXPECT_TRUE(bitwise_equal(ref[i], mixed[i])) << "unit " << i / 4 << " state " << i % 4;
      }
    }
  }
}

// Stage 3 gathers in the trainer's order: ranks that gather equal-sized units in different
// orders would all-gather one rank's shard of one unit with another's of the other.
TEST(Order, Stage3GathersInDifferentOrdersFailEveryRankAtStep) {
  const int n = world()->size(), rank = world()->rank();
  Engine e(make_config(3, DType::f32, 1), world());
  for (const char* name : {"a", "b", "c"}) e.add_unit(name, {Param{"w", {4, 8}}});
  e.finalize();
  const std::vector<float> before = e.read_shard(0, StateKind::master);
  // Rank 1 gathers b before a; everyone else a before b.
  std::vector<int> order = rank == 1 ? std::vector<int>{1, 0, 2} : std::vector<int>{0, 1, 2};
  for (int u : order) {
    e.gather(u);
    e.release(u);
  }
  for (int u = 2; u >= 0; --u) {
    for (TensorView& g : e.grads(u)) std::fill(g.as<float>(), g.as<float>() + g.numel, 0.5f);
    e.grads_ready(u);
  }
  if (n == 1) {
    EXPECT_FALSE(e.step().skipped);  // one rank agrees with itself
    return;
  }
  EXPECT_ZS_ERROR(e.step(), model_mismatch,
                  "collective 1 is the all-gather for gather() of unit 'a' on rank 0 but the "
                  "all-gather for gather() of unit 'b' on rank 1");
  EXPECT_TRUE(bitwise_equal(before, e.read_shard(0, StateKind::master))) << "something applied";
  // The engine goes on: the same step in agreeing orders works.
  for (int u = 2; u >= 0; --u) {
    e.gather(u);
    e.release(u);
  }
  for (int u = 2; u >= 0; --u) {
    for (TensorView& g : e.grads(u)) std::fill(g.as<float>(), g.as<float>() + g.numel, 0.5f);
    e.grads_ready(u);
  }
  EXPECT_FALSE(e.step().skipped);
}

// A unit handed over before its turn waits for the units before it; the trainer learns which.
TEST(Order, WaitingUnitsNameTheUnitTheyWaitFor) {
  Engine e(make_config(2, DType::f32, 1), world());
  for (const char* name : {"a", "b", "c"}) e.add_unit(name, {Param{"w", {4, 8}}});
  e.finalize();
  e.grads(0);
  e.grads_ready(0);  // a's turn comes after c's and b's
  EXPECT_ZS_ERROR(e.grads(0), invalid_argument,
                  "unit 'a': its gradients of the last micro-step wait for unit 'c'");
  EXPECT_ZS_ERROR(e.step(), invalid_argument,
                  "unit 'c' has the gradients of 0 of 1 micro-steps (gradient_accumulation_steps); "
                  "the units handed over after it wait for it");
  e.zero_grad();
  for (int u = 2; u >= 0; --u) {
    e.grads(u);
    e.grads_ready(u);
  }
  EXPECT_FALSE(e.step().skipped);
}

// A gather between clip_grad_norm() and step() (a trainer logging a layer's weights, say)
// prefetches the next unit with the parameters of before the update. step() must drop that
// prefetch, or the next step's gather of that unit hands out stale values; on a GPU its copy
// up would also still read staging the update frees. Bitwise as without the extra gather.
TEST(Order, Stage3GatherBetweenClipAndStepLeavesNoStalePrefetch) {
  for (Tier params : {Tier::device, Tier::host, Tier::nvme}) {
    SCOPED_TRACE(std::string("parameters on ") + tier_name(params));
    auto train = [&](bool peek) {
      Config cfg = make_config(3, DType::bf16, 1);
      cfg.offload_param.tier = params;
      if (params != Tier::device) cfg.offload_optimizer.tier = Tier::host;
      if (params == Tier::nvme) cfg.offload_param.nvme_paths = {"/tmp"};
      Engine e(cfg, world());
      zs_test::register_model(e, zs_test::uneven_model());
      zs_test::TrainOptions opt;
      opt.steps = 4;
      if (peek)
        opt.before_step = [](Engine& en) {
          en.clip_grad_norm(1.0);
          const int last = en.num_units() - 1;  // first in the recorded (backward) order
          (void)en.gather(last);                // prefetches the next in that order
          en.release(last);
        };
      for (const StepResult& r : zs_test::train(e, opt)) EXPECT_FALSE(r.skipped);
      std::vector<std::vector<float>> out;
      for (int u = 0; u < e.num_units(); ++u)
        for (StateKind k : {StateKind::param, StateKind::master, StateKind::state0})
          out.push_back(e.read_shard(u, k));
      return out;
    };
    const auto ref = train(false), peeked = train(true);
    ASSERT_EQ(ref.size(), peeked.size());
    for (size_t i = 0; i < ref.size(); ++i)
      EXPECT_TRUE(bitwise_equal(ref[i], peeked[i])) << "unit " << i / 3 << " state " << i % 3;
  }
}
