#pragma once
// Loss scaling with DeepSpeed's dynamic semantics: start at 2^initial_scale_power; an overflow
// skips the step and, once `hysteresis` overflows have been seen, halves the scale (never below
// min_scale); a clean step i doubles the scale and refills hysteresis when i - j - 1 > 0 and
// (i - j - 1) % window == 0, j being the last overflowing step (-1 at start): DeepSpeed >= 0.17.1.

#include <cstdint>

#include "zeroshard/config.hpp"

namespace zeroshard {

class LossScaler {
 public:
  /// dynamic: f16 without a static scale. Otherwise the scale is static_scale (if > 0) or 1.
  LossScaler(const LossScaleOptions& o, bool dynamic);
  float scale() const { return scale_; }
  void set_scale(float s) { scale_ = s; }
  LossScalerState state() const { return {scale_, hysteresis_left_, iter_, last_overflow_iter_}; }
  void set_state(const LossScalerState& s) {
    scale_ = s.scale;
    hysteresis_left_ = s.hysteresis_left;
    iter_ = s.iteration;
    last_overflow_iter_ = s.last_overflow;
  }
  /// Records one step's outcome (after the all-reduce that agreed on `overflow`).
  void update(bool overflow);
  /// Whether an overflow now would need the scale below min_scale: the scale cannot absorb it,
  /// and every later step would overflow and be skipped too (DeepSpeed skips them; zeroshard
  /// raises instead, see the README).
  bool at_floor() const { return dynamic_ && hysteresis_left_ <= 1 && scale_ <= o_.min_scale; }
  const LossScaleOptions& options() const { return o_; }

 private:
  LossScaleOptions o_;
  bool dynamic_;
  float scale_;
  int hysteresis_left_;
  int64_t iter_ = 0;
  int64_t last_overflow_iter_ = -1;
};

}  // namespace zeroshard
