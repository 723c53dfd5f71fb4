#pragma once
/// \file planner.hpp
/// What an engine would hold, before anyone allocates it: the memory half of the planner.

#include <string>
#include <vector>

#include "zeroshard/config.hpp"
#include "zeroshard/export.hpp"
#include "zeroshard/memory.hpp"
#include "zeroshard/param.hpp"

namespace zeroshard {

/// One unit as Engine::add_unit() takes it (initial values are ignored).
struct PlanUnit {
  std::string name;
  std::vector<Param> params;
};

/// The bytes rank `rank` of an engine with `cfg` on `world` ranks holds once finalize() has run,
/// by tier × kind and by named buffer: what that engine's Engine::memory() reports, exactly,
/// because it is computed by the engine's own setup (layout, tiers, buffer pools, swap records)
/// with the ledger counting buffers instead of allocating them. The rank's collectives are
/// answered locally (every rank is assumed to register the same model); nvme swap files are
/// laid out in a temporary directory, sparse, and removed, so the configured nvme paths need not
/// exist here. `groups` are the parameter groups after the first (Engine::add_group()).
/// CPU engines only (Config::device cpu): planning a GPU engine needs its device's allocator.
/// Throws Error (invalid_argument) for what the engine itself would refuse.
ZS_API MemoryReport plan_memory(const Config& cfg, const std::vector<PlanUnit>& units, int world,
                                int rank = 0, const std::vector<OptimizerOptions>& groups = {});

}  // namespace zeroshard
