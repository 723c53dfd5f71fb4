#pragma once
// One unit's optimizer update as the tiers describe it, and its split into CPU tasks.

#include <utility>
#include <vector>

#include "base/layout.hpp"
#include "kernels/cpu/arena.hpp"
#include "kernels/cpu/cpu_kernels.hpp"

namespace zeroshard::cpu {

/// One unit's optimizer update: `args` points at element 0 of the state's extent (args.n
/// elements; grad and out index alike) and `runs` are the group runs inside it.
struct UnitUpdate {
  const std::vector<GroupRun>* runs = nullptr;
  UpdateArgs args;
};

/// One CPU task: at most Arena::kChunk elements of one run, with its group's hyperparameters;
/// for q8 moments, a block-aligned chunk of the extent with the segments of the runs in it, and
/// the ranges of held runs (UpdateHyper::hold) in it, whose moments are requantized with their
/// blocks but not updated.
struct UpdateTask {
  const UpdateHyper* h;
  UpdateArgs a;
  std::vector<UpdateSegment> segments;            ///< q8 only
  std::vector<std::pair<int64_t, int64_t>> held;  ///< q8 only: [begin, end) in the chunk
};

/// `a` advanced by `b` elements (every array, including the q8 absmax at a block boundary).
UpdateArgs offset_args(const UpdateArgs& a, int64_t b);

/// Runs one task (single-threaded) with `isa`.
void run_update_task(Isa isa, const UpdateTask& t);

/// Appends `unit`'s tasks, so small units and big ones share the arena evenly.
void append_update_tasks(const std::vector<UpdateHyper>& hyper, const UnitUpdate& unit,
                         std::vector<UpdateTask>& tasks);

/// Runs the tasks on the arena.
void run_update_tasks(Arena& arena, const std::vector<UpdateTask>& tasks);

}  // namespace zeroshard::cpu
