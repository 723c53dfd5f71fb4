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

/// One stage and offload choice, planned: bytes per tier (every kind) and the model states
/// (parameters, gradients, master weights, optimizer state, on every tier), each of the rank
/// that holds the most (rank 0 or rank world − 1: shards differ only where padding falls).
struct PlanChoice {
  int stage = 0;
  Tier optimizer = Tier::device;  ///< offload_optimizer
  Tier params = Tier::device;     ///< offload_param (stage 3; device below)
  int64_t tier_bytes[kNumTiers] = {};
  int64_t model_states = 0;
};

/// plan_memory() for every stage and offload choice (stages 0–3; optimizer state on the device,
/// host or, from stage 1, nvme tier; at stage 3 parameters on each tier too), with `base`'s other
/// settings: what `zeroshard plan` and zeroshard.estimate() print.
ZS_API std::vector<PlanChoice> plan_choices(const Config& base, const std::vector<PlanUnit>& units,
                                            int world,
                                            const std::vector<OptimizerOptions>& groups = {});

}  // namespace zeroshard
