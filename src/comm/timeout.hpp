#pragma once
// A collective's timeout as a steady_clock duration. Seconds beyond kMaxTimeoutS (about three
// years) count as that many: "never time out" spelled 1e10 or 1e300 stays a deadline in the
// future, where converting it whole would overflow the clock's 64-bit nanoseconds into the past
// and fail every collective at once. NaN and negative values count as 0.

#include <chrono>

namespace zeroshard {

inline constexpr double kMaxTimeoutS = 1e8;

template <class Clock = std::chrono::steady_clock>
typename Clock::duration timeout_duration(double seconds) {
  const double s = seconds > kMaxTimeoutS ? kMaxTimeoutS : (seconds > 0 ? seconds : 0.0);
  return std::chrono::duration_cast<typename Clock::duration>(std::chrono::duration<double>(s));
}

}  // namespace zeroshard
