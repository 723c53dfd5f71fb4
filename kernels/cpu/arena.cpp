#include "kernels/cpu/arena.hpp"

#include <tbb/parallel_for.h>

#include <algorithm>
#include <cstdlib>
#include <thread>
#include <vector>

#include "zeroshard/launch.hpp"

namespace zeroshard::cpu {
namespace {

// Ranks sharing a machine share its cores: by default each takes cores / local ranks, read from
// the launcher's environment (launch_info()). ZEROSHARD_CPU_THREADS overrides.
int default_threads() {
  if (const char* s = std::getenv("ZEROSHARD_CPU_THREADS")) {
    int n = std::atoi(s);
    if (n > 0) return n;
  }
  int cores = int(std::max(1u, std::thread::hardware_concurrency()));
  return std::max(1, cores / launch_info().local_size);
}

}  // namespace

Arena::Arena(int threads)
    : threads_(threads > 0 ? threads : default_threads()), isa_(best_isa()), arena_(threads_) {}

void Arena::parallel_chunks(int64_t n, const std::function<void(int64_t, int64_t)>& body) {
  if (n <= 0) return;
  parallel_for((n + kChunk - 1) / kChunk,
               [&](int64_t c) { body(c * kChunk, std::min(n, (c + 1) * kChunk)); });
}

void Arena::parallel_for(int64_t count, const std::function<void(int64_t)>& body) {
  if (count <= 1 || threads_ == 1) {
    for (int64_t i = 0; i < count; ++i) body(i);
    return;
  }
  arena_.execute([&] { tbb::parallel_for(int64_t(0), count, [&](int64_t i) { body(i); }); });
}

double Arena::parallel_sum(int64_t n, const std::function<double(int64_t, int64_t)>& f) {
  if (n <= 0) return 0.0;
  int64_t chunks = (n + kChunk - 1) / kChunk;
  std::vector<double> part(size_t(chunks), 0.0);
  parallel_chunks(n, [&](int64_t b, int64_t e) { part[size_t(b / kChunk)] = f(b, e); });
  double s = 0.0;
  for (double p : part) s += p;
  return s;
}

int Arena::slot() const {
  // Outside the arena (a serial loop on the caller's thread) the index is -1.
  const int ti = tbb::this_task_arena::current_thread_index();
  return ti < 0 || ti >= threads_ ? 0 : ti;
}

}  // namespace zeroshard::cpu
