#pragma once
// Resources the engine owns (DESIGN.md rule 4): the CPU worker arena and the kernel ISA.
// No globals: each engine has its own.

#include <tbb/task_arena.h>

#include <cstdint>
#include <functional>

#include "kernels/cpu/cpu_kernels.hpp"

namespace zeroshard {

class Resources {
 public:
  Resources();
  int threads() const { return threads_; }
  cpu::Isa isa() const { return isa_; }

  /// Runs body(begin, end) over [0, n) split into chunks of kChunk elements, in parallel on the
  /// arena. Chunk boundaries depend only on n, so per-chunk results are reproducible.
  void parallel_chunks(int64_t n, const std::function<void(int64_t, int64_t)>& body);
  /// Runs body(i) for i in [0, count) in parallel on the arena.
  void parallel_for(int64_t count, const std::function<void(int64_t)>& body);
  /// Σ over chunks of f(begin, end), chunks summed in index order: deterministic in double.
  double parallel_sum(int64_t n, const std::function<double(int64_t, int64_t)>& f);

  static constexpr int64_t kChunk = 1 << 16;

 private:
  int threads_;
  cpu::Isa isa_;
  tbb::task_arena arena_;
};

}  // namespace zeroshard
