#pragma once
// The argument check every Communicator::split() implementation makes before any rank joins.

#include <algorithm>
#include <sstream>
#include <string>
#include <vector>

#include "base/check.hpp"

namespace zeroshard {

/// Throws Error(invalid_argument) unless `ranks` are ascending, distinct ranks of `size`,
/// `rank` among them.
inline void check_split(const std::vector<int>& ranks, int rank, int size,
                        const std::string& what) {
  bool ok = !ranks.empty() && std::find(ranks.begin(), ranks.end(), rank) != ranks.end();
  for (size_t i = 0; ok && i < ranks.size(); ++i)
    ok = ranks[i] >= 0 && ranks[i] < size && (i == 0 || ranks[i - 1] < ranks[i]);
  if (ok) return;
  std::ostringstream list;
  for (size_t i = 0; i < ranks.size(); ++i) list << (i ? ", " : "") << ranks[i];
  ZS_THROW(invalid_argument, "rank " << rank << ": split of " << what << ": ranks {" << list.str()
                                     << "} must be ascending ranks of the " << size
                                     << ", this rank among them");
}

}  // namespace zeroshard
