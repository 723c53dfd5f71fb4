#include "kernels/cpu/update_tasks.hpp"

#include <algorithm>

namespace zeroshard::cpu {

UpdateArgs offset_args(const UpdateArgs& w, int64_t b) {
  UpdateArgs a = w;
  const size_t gsize = dtype_size(w.grad_dtype), osize = dtype_size(w.out_dtype);
  const size_t ssize = state_bytes(w.state_format);
  a.master = static_cast<char*>(w.master) + size_t(b) * dtype_size(w.master_dtype);
  a.index = w.index + b;
  a.state0 = w.state0 ? static_cast<char*>(w.state0) + size_t(b) * ssize : nullptr;
  a.state1 = w.state1 ? static_cast<char*>(w.state1) + size_t(b) * ssize : nullptr;
  if (w.state_format == StateFormat::q8) {
    a.absmax0 = w.absmax0 ? w.absmax0 + b / w.block : nullptr;
    a.absmax1 = w.absmax1 ? w.absmax1 + b / w.block : nullptr;
  }
  a.grad = static_cast<const char*>(w.grad) + size_t(b) * gsize;
  a.out = w.out ? static_cast<char*>(w.out) + size_t(b) * osize : nullptr;
  a.dir = w.dir ? w.dir + b : nullptr;
  a.n = w.n - b;
  return a;
}

void append_update_tasks(const std::vector<UpdateHyper>& hyper, const UnitUpdate& unit,
                         std::vector<UpdateTask>& tasks) {
  const UpdateArgs& w = unit.args;
  if (w.state_format == StateFormat::q8) {
    // Blocks are requantized whole, so tasks split the extent at block boundaries (a chunk is
    // a multiple of every block size) and carry the runs inside them.
    static_assert(Arena::kChunk % kMaxStateBlock == 0);
    for (int64_t b = 0; b < w.n; b += Arena::kChunk) {
      UpdateTask t{nullptr, offset_args(w, b), {}, {}};
      t.a.n = std::min(w.n, b + Arena::kChunk) - b;
      for (const GroupRun& run : *unit.runs) {
        const int64_t lo = std::max(run.begin, b), hi = std::min(run.end, b + t.a.n);
        if (lo >= hi) continue;
        const UpdateHyper& h = hyper[size_t(run.group)];
        if (h.hold)
          t.held.emplace_back(lo - b, hi - b);
        else
          t.segments.push_back({lo - b, hi - b, &h});
      }
      if (!t.segments.empty() || !t.held.empty()) tasks.push_back(std::move(t));
    }
    return;
  }
  for (const GroupRun& run : *unit.runs) {
    for (int64_t b = run.begin; b < run.end; b += Arena::kChunk) {
      UpdateArgs a = offset_args(w, b);
      a.n = std::min(run.end, b + Arena::kChunk) - b;
      tasks.push_back({&hyper[size_t(run.group)], a, {}, {}});
    }
  }
}

// A held range: the parameters are rewritten from the master, which stays as it is.
void hold(Isa isa, const UpdateArgs& a, int64_t begin, int64_t end) {
  if (!a.out || begin >= end) return;
  convert(isa, static_cast<const char*>(a.master) + size_t(begin) * dtype_size(a.master_dtype),
          a.master_dtype, static_cast<char*>(a.out) + size_t(begin) * dtype_size(a.out_dtype),
          a.out_dtype, end - begin);
}

void run_update_task(Isa isa, const UpdateTask& t) {
  if (t.h) {
    if (t.h->hold)
      hold(isa, t.a, 0, t.a.n);
    else
      optimizer_update(isa, *t.h, t.a);
    return;
  }
  if (!t.segments.empty())
    optimizer_update_segments(isa, t.segments.data(), int(t.segments.size()), t.a);
  for (auto [begin, end] : t.held) hold(isa, t.a, begin, end);
}

void run_update_tasks(Arena& arena, const std::vector<UpdateTask>& tasks) {
  arena.parallel_for(int64_t(tasks.size()),
                     [&](int64_t t) { run_update_task(arena.isa(), tasks[size_t(t)]); });
}

}  // namespace zeroshard::cpu
