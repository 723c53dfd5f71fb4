#pragma once
// Pieces the CPU benchmarks share: huge-page-backed buffers, cheap deterministic values, the
// median of a series, and wall and process-CPU clocks.

#include <sys/mman.h>
#include <tbb/blocked_range.h>
#include <tbb/parallel_for.h>
#include <tbb/partitioner.h>
#include <tbb/task_arena.h>
#include <time.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <vector>

namespace zs_bench {

// A page-aligned buffer, backed by transparent huge pages where the kernel allows, so every
// kernel compared sees the same TLB behaviour.
struct Buffer {
  struct Free {
    void operator()(void* p) const { std::free(p); }
  };
  std::unique_ptr<unsigned char, Free> mem;
  explicit Buffer(size_t bytes) {
    constexpr size_t kAlign = size_t{2} << 20;
    const size_t rounded = (bytes + kAlign - 1) / kAlign * kAlign;
    mem.reset(static_cast<unsigned char*>(std::aligned_alloc(kAlign, rounded)));
    if (!mem) {
      std::fprintf(stderr, "out of memory (%zu bytes)\n", rounded);
      std::exit(2);
    }
    madvise(mem.get(), rounded, MADV_HUGEPAGE);
  }
  float* f32() const { return reinterpret_cast<float*>(mem.get()); }
  uint16_t* u16() const { return reinterpret_cast<uint16_t*>(mem.get()); }
};

// Deterministic, cheap, well-spread values in [lo, hi): initialising 10^8 elements through
// <random> would dominate start-up.
inline float hashed(int64_t i, float lo, float hi) {
  uint64_t x = static_cast<uint64_t>(i) * 0x9E3779B97F4A7C15ull;
  x ^= x >> 29;
  x *= 0xBF58476D1CE4E5B9ull;
  x ^= x >> 32;
  return lo + (hi - lo) * static_cast<float>(x >> 40) * (1.0f / 16777216.0f);
}

inline double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

/// CPU seconds used by every thread of this process so far.
inline double process_cpu_s() {
  timespec t{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
  return double(t.tv_sec) + 1e-9 * double(t.tv_nsec);
}

// By value: the caller's per-round series stays in round order.
inline double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t k = v.size() / 2;
  return v.size() % 2 ? v[k] : 0.5 * (v[k - 1] + v[k]);
}

/// Runs body(begin, end) over [0, n) in fixed chunks on `arena`, exactly one chunk per task:
/// the engine's scheme (cpu::Arena::parallel_chunks), and the same for every kernel compared.
template <class Body>
void for_chunks(tbb::task_arena& arena, int64_t n, int64_t chunk, const Body& body) {
  const int64_t chunks = (n + chunk - 1) / chunk;
  arena.execute([&] {
    tbb::parallel_for(
        tbb::blocked_range<int64_t>(0, chunks, 1),
        [&](const tbb::blocked_range<int64_t>& r) {
          for (int64_t c = r.begin(); c < r.end(); ++c)
            body(c * chunk, std::min(n, (c + 1) * chunk));
        },
        tbb::simple_partitioner());
  });
}

}  // namespace zs_bench
