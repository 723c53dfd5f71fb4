#pragma once
// Where the CPU kernels run: a oneTBB task arena of a fixed number of threads, the kernel ISA
// chosen once for this machine, and the loops every CPU tier splits its work with. One arena per
// engine (owned by its Resources); no globals.

#include <tbb/task_arena.h>

#include <cstdint>
#include <functional>

#include "kernels/cpu/cpu_kernels.hpp"

namespace zeroshard::cpu {

class Arena {
 public:
  /// threads <= 0: the default (cores / ranks on this machine, or ZEROSHARD_CPU_THREADS).
  explicit Arena(int threads = 0);
  int threads() const { return threads_; }
  Isa isa() const { return isa_; }

  /// Runs body(begin, end) over [0, n) split into chunks of kChunk elements, in parallel on the
  /// arena. Chunk boundaries depend only on n, so per-chunk results are reproducible.
  void parallel_chunks(int64_t n, const std::function<void(int64_t, int64_t)>& body);
  /// Runs body(i) for i in [0, count) in parallel on the arena.
  void parallel_for(int64_t count, const std::function<void(int64_t)>& body);
  /// Σ over chunks of f(begin, end), chunks summed in index order: deterministic in double.
  double parallel_sum(int64_t n, const std::function<double(int64_t, int64_t)>& f);
  /// The arena slot of the calling thread, in [0, threads()): per-thread scratch memory.
  int slot() const;

  static constexpr int64_t kChunk = 1 << 16;

 private:
  int threads_;
  Isa isa_;
  tbb::task_arena arena_;
};

}  // namespace zeroshard::cpu
