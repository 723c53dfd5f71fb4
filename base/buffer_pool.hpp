#pragma once
// A pool of buffers the stage logic and the tiers cycle (gradient staging, stage-3 gather, GPU
// reduce-scatter outputs), each slot owned by one unit at a time.

#include <functional>
#include <vector>

#include "base/ledger.hpp"

namespace zeroshard {

/// A fixed pool of buffers: memory stays bounded by what fill() made, whatever the model. Slots
/// may differ in size; a unit takes the smallest free one that holds it, so the pool's slots
/// can be sized by the units they serve rather than all by the largest.
struct BufferPool {
  std::vector<Buffer> buffers;
  std::vector<int> owner;  // unit holding each buffer, -1 when free
  void fill(int count, const std::function<Buffer()>& make);
  /// The smallest free slot of at least `bytes` (the first of equals), now owned by `unit`;
  /// -1 when none is free and large enough.
  int acquire(int unit, size_t bytes = 0);
  void release(int slot) { owner[size_t(slot)] = -1; }
  void* data(int slot) const { return buffers[size_t(slot)].data(); }
};

}  // namespace zeroshard
