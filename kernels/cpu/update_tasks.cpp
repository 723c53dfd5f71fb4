#include "kernels/cpu/update_tasks.hpp"

#include <algorithm>

namespace zeroshard::cpu {

void append_update_tasks(const std::vector<UpdateHyper>& hyper, const UnitUpdate& unit,
                         std::vector<UpdateTask>& tasks) {
  const UpdateArgs& w = unit.args;
  const size_t gsize = dtype_size(w.grad_dtype), osize = dtype_size(w.out_dtype);
  for (const GroupRun& run : *unit.runs) {
    for (int64_t b = run.begin; b < run.end; b += Arena::kChunk) {
      UpdateArgs a = w;
      a.master = w.master + b;
      a.state0 = w.state0 ? w.state0 + b : nullptr;
      a.state1 = w.state1 ? w.state1 + b : nullptr;
      a.grad = static_cast<const char*>(w.grad) + size_t(b) * gsize;
      a.out = w.out ? static_cast<char*>(w.out) + size_t(b) * osize : nullptr;
      a.n = std::min(run.end, b + Arena::kChunk) - b;
      tasks.push_back({&hyper[size_t(run.group)], a});
    }
  }
}

void run_update_tasks(Arena& arena, const std::vector<UpdateTask>& tasks) {
  arena.parallel_for(int64_t(tasks.size()), [&](int64_t t) {
    optimizer_update(arena.isa(), *tasks[size_t(t)].h, tasks[size_t(t)].a);
  });
}

}  // namespace zeroshard::cpu
