// The dynamic loss scale's sequence, step by step, against DeepSpeed's rule since 0.17.1 (its
// PR #6976): after an overflow at step j, the scale grows at step i when i - j - 1 > 0 and
// (i - j - 1) % loss_scale_window == 0 (j = -1 before any overflow).
#include <gtest/gtest.h>

#include <algorithm>
#include <random>
#include <vector>

#include "src/precision/loss_scaler.hpp"

using namespace zeroshard;

namespace {

// DeepSpeed's DynamicLossScaler.update_scale, written out here from its rule.
struct Reference {
  LossScaleOptions o;
  float scale;
  int hysteresis;
  int64_t iter = 0, last_overflow = -1;

  explicit Reference(const LossScaleOptions& opt)
      : o(opt), scale(float(1 << opt.initial_scale_power)), hysteresis(opt.hysteresis) {}
  void update(bool overflow) {
    if (overflow) {
      if (o.hysteresis == 1 || hysteresis == 1)
        scale = std::max(scale / 2, o.min_scale);
      else
        --hysteresis;
      last_overflow = iter;
    } else {
      if (o.consecutive_hysteresis) hysteresis = o.hysteresis;
      const int64_t stable = iter - last_overflow - 1;
      if (stable > 0 && stable % o.window == 0) {
        if (!o.consecutive_hysteresis) hysteresis = o.hysteresis;
        scale *= 2;
      }
    }
    ++iter;
  }
};

LossScaleOptions options(int window, int hysteresis, bool consecutive) {
  LossScaleOptions o;
  o.initial_scale_power = 8;
  o.window = window;
  o.hysteresis = hysteresis;
  o.consecutive_hysteresis = consecutive;
  o.min_scale = 1;
  return o;
}

std::vector<float> run(LossScaler& s, const std::vector<bool>& overflows) {
  std::vector<float> out;
  for (bool of : overflows) {
    s.update(of);
    out.push_back(s.scale());
  }
  return out;
}

}  // namespace

// No overflow, window 2: the scale doubles after steps 2, 4, 6 (0-based), not after 1, 3, 5 as
// under the rule before DeepSpeed 0.17.1.
TEST(LossScaler, CleanStepsGrowAfterAWholeWindow) {
  LossScaler s(options(2, 2, false), true);
  EXPECT_EQ(run(s, std::vector<bool>(7, false)),
            (std::vector<float>{256, 256, 512, 512, 1024, 1024, 2048}));
  LossScaler one(options(1, 2, false), true);  // window 1: from the second clean step on
  EXPECT_EQ(run(one, std::vector<bool>(4, false)), (std::vector<float>{256, 512, 1024, 2048}));
}

// An overflow at step 1 (hysteresis 1 halves at once): the next growth is after two clean
// steps that follow it, at step 4.
TEST(LossScaler, AfterAnOverflowTheWindowStartsAgain) {
  LossScaler s(options(2, 1, false), true);
  EXPECT_EQ(run(s, {false, true, false, false, false, false, false}),
            (std::vector<float>{256, 128, 128, 128, 256, 256, 512}));
}

// Every step overflowing: hysteresis 2 absorbs the first, then each halves down to the floor.
TEST(LossScaler, EveryStepOverflowingHalvesToTheFloor) {
  LossScaler s(options(2, 2, false), true);
  std::vector<float> got = run(s, std::vector<bool>(10, true));
  EXPECT_EQ(got, (std::vector<float>{256, 128, 64, 32, 16, 8, 4, 2, 1, 1}));
  EXPECT_TRUE(s.at_floor());
}

// Some steps overflowing, in patterns drawn from a seed, for every window, hysteresis and
// consecutive_hysteresis: the same scale as the reference after every step.
TEST(LossScaler, MatchesDeepSpeedOnAnyPattern) {
  std::mt19937 rng(7);
  for (int window : {1, 2, 3, 5})
    for (int hysteresis : {1, 2, 3})
      for (bool consecutive : {false, true})
        for (double p : {0.1, 0.3, 0.6}) {
          LossScaleOptions o = options(window, hysteresis, consecutive);
          o.initial_scale_power = 20;  // far from the floor: every step is the rule's
          LossScaler s(o, true);
          Reference ref(o);
          std::bernoulli_distribution overflow(p);
          for (int i = 0; i < 200; ++i) {
            const bool of = overflow(rng);
            s.update(of);
            ref.update(of);
            ASSERT_EQ(s.scale(), ref.scale)
                << "step " << i << ", window " << window << ", hysteresis " << hysteresis
                << ", consecutive " << consecutive << ", p " << p;
            ASSERT_EQ(s.state().hysteresis_left, ref.hysteresis) << "step " << i;
          }
        }
}

// A static scale never moves, whatever overflows, and needs no window.
TEST(LossScaler, StaticScaleIgnoresTheWindow) {
  LossScaleOptions o = options(0, 2, false);
  o.static_scale = 128;
  LossScaler s(o, false);
  EXPECT_EQ(run(s, {true, false, true, false}), (std::vector<float>{128, 128, 128, 128}));
}
