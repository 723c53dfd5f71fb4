#pragma once
// A fixed pool of equal buffers the stage logic and the tiers cycle (gradient staging, stage-3
// gather, GPU reduce-scatter outputs), each slot owned by one unit at a time.

#include <functional>
#include <vector>

#include "src/base/ledger.hpp"

namespace zeroshard {

/// A fixed pool of equal buffers (gradient staging, stage-3 gather): memory stays bounded by
/// count × the largest unit, whatever the model.
struct BufferPool {
  std::vector<Buffer> buffers;
  std::vector<int> owner;  // unit holding each buffer, -1 when free
  void fill(int count, const std::function<Buffer()>& make);
  int acquire(int unit);  // a free slot or -1
  void release(int slot) { owner[size_t(slot)] = -1; }
  void* data(int slot) const { return buffers[size_t(slot)].data(); }
};

}  // namespace zeroshard
