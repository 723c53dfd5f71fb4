#pragma once
// What every Communicator::all_to_all() implementation checks and needs of its pieces (here, on
// the ground floor, as the communicators are in two rooms: src/comm and src/compute).

#include <algorithm>
#include <cstdint>
#include <string>

#include "base/check.hpp"
#include "zeroshard/communicator.hpp"

namespace zeroshard {

/// Throws Error(invalid_argument) unless `p` has one count and one offset per rank of `size`,
/// none negative. `name` is "send" or "recv".
inline void check_pieces(const Pieces& p, int rank, int size, const std::string& what,
                         const char* name) {
  if (p.counts.size() != size_t(size) || p.offsets.size() != size_t(size))
    ZS_THROW(invalid_argument, "rank " << rank << ": all_to_all of " << what << ": " << name
                                       << " pieces give " << p.counts.size() << " counts and "
                                       << p.offsets.size() << " offsets for " << size << " ranks");
  for (int q = 0; q < size; ++q)
    if (p.counts[size_t(q)] < 0 || p.offsets[size_t(q)] < 0)
      ZS_THROW(invalid_argument, "rank " << rank << ": all_to_all of " << what << ": " << name
                                         << " piece " << q << " has count " << p.counts[size_t(q)]
                                         << " at offset " << p.offsets[size_t(q)]);
}

/// Elements from the buffer's start to the end of its last piece (0 when every count is 0).
inline int64_t pieces_extent(const Pieces& p) {
  int64_t end = 0;
  for (size_t q = 0; q < p.counts.size(); ++q)
    if (p.counts[q] > 0) end = std::max(end, p.offsets[q] + p.counts[q]);
  return end;
}

/// Whether the pieces move nothing.
inline bool pieces_empty(const Pieces& p) {
  for (int64_t c : p.counts)
    if (c > 0) return false;
  return true;
}

}  // namespace zeroshard
