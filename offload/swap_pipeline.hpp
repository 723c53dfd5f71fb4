#pragma once
// The swap pipeline of the NVMe optimizer step: units stream through a fixed pool of pinned
// slots, so that while unit k is updated, units k+1 … k+read_ahead are being read and units
// k−1, k−2 … are being written back. Memory stays at pool.count() × slot size whatever the
// model; the drive and the CPU work at the same time.

#include <functional>
#include <memory>
#include <optional>
#include <vector>

#include "offload/io_queue.hpp"
#include "offload/pinned_pool.hpp"
#include "zeroshard/error.hpp"

namespace zeroshard::offload {

struct PipelineHooks {
  /// Starts the reads that unit `i` needs into `slot`; returns their batches (may be none).
  std::function<std::vector<std::shared_ptr<IoBatch>>(int i, int slot)> read;
  /// Updates unit `i` in `slot` once its reads succeeded (runs on the calling thread).
  std::function<void(int i, int slot)> update;
  /// Starts unit `i`'s write-back from `slot`; the slot is reused once these batches are done.
  std::function<std::vector<std::shared_ptr<IoBatch>>(int i, int slot)> write;
};

struct PipelineResult {
  std::optional<Error> error;  ///< the first failure, if any
  int updated = 0;             ///< units 0 … updated−1 went through update()
};

/// Runs units 0 … n−1 through the hooks in order. Stops at the first failed read or write
/// (nothing more is updated; later writes are not started). Returns once no I/O it started is
/// in flight and every slot it took is back in `pool`. read_ahead >= 0.
PipelineResult run_pipeline(IoQueue& io, PinnedPool& pool, int n, int read_ahead,
                            const PipelineHooks& hooks);

}  // namespace zeroshard::offload
