#pragma once
// The clock and the median the planner's measurements (time_collectives(), time_pcie(),
// time_update()) take their figures with.

#include <algorithm>
#include <chrono>
#include <vector>

namespace zeroshard::timing {

/// Seconds on the steady clock.
inline double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

/// The upper median of a non-empty series.
inline double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace zeroshard::timing
