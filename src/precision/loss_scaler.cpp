#include "src/precision/loss_scaler.hpp"

#include <algorithm>
#include <cmath>

namespace zeroshard {

LossScaler::LossScaler(const LossScaleOptions& o, bool dynamic)
    : o_(o),
      dynamic_(dynamic),
      scale_(dynamic ? std::ldexp(1.0f, o.initial_scale_power)
                     : (o.static_scale > 0 ? o.static_scale : 1.0f)),
      hysteresis_left_(o.hysteresis) {}

void LossScaler::update(bool overflow) {
  if (!dynamic_) return;
  if (overflow) {
    // Hysteresis tolerates isolated overflows (a spike) before giving up precision.
    if (hysteresis_left_ <= 1)
      scale_ = std::max(scale_ / 2.0f, o_.min_scale);
    else
      --hysteresis_left_;
    last_overflow_iter_ = iter_;
  } else {
    if (o_.consecutive_hysteresis) hysteresis_left_ = o_.hysteresis;
    // DeepSpeed's rule since 0.17.1 (its PR #6976), last_overflow_iter_ being -1 at start.
    const int64_t stable = iter_ - last_overflow_iter_ - 1;
    if (stable > 0 && stable % o_.window == 0) {
      hysteresis_left_ = o_.hysteresis;
      scale_ *= 2.0f;
    }
  }
  ++iter_;
}

}  // namespace zeroshard
