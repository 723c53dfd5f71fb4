#pragma once
// Layout planning: how each unit's parameters are flattened, padded and split into shards.
// The planner's estimate and the engine's allocation both come from here.

#include <cstdint>
#include <string>
#include <vector>

#include "zeroshard/config.hpp"
#include "zeroshard/param.hpp"

namespace zeroshard {

/// One parameter's place in its unit's flat buffer, in elements.
struct ParamSlot {
  std::string name;
  std::vector<int64_t> shape;
  int group = 0;
  int64_t offset = 0;
  int64_t numel = 0;
};

/// A contiguous range of one parameter group, in elements relative to a base offset.
struct GroupRun {
  int64_t begin = 0;
  int64_t end = 0;
  int group = 0;
};

struct UnitLayout {
  std::string name;
  std::vector<ParamSlot> params;
  int64_t numel = 0;         // parameters, packed back to back from offset 0
  int64_t padded_numel = 0;  // numel rounded up to world_size × alignment
  int64_t shard_numel = 0;   // padded_numel / world_size

  /// Group runs covering the parameters inside [begin, end) of the flat buffer, relative to
  /// `begin`. Adjacent parameters of one group merge into one run; padding belongs to no run.
  std::vector<GroupRun> runs(int64_t begin, int64_t end) const;
};

/// A unit as one rank sees it: its layout and the group runs of its whole and of this rank's
/// shard. Fixed once the engine is finalized; every tier reads it.
struct UnitShape {
  UnitLayout layout;
  std::vector<GroupRun> shard_runs;  // this rank's shard, relative to the shard start
  std::vector<GroupRun> whole_runs;  // the whole unit (stage 0 updates it all)
};

int64_t round_up(int64_t n, int64_t multiple);

/// Zeroes the padding of this rank's shard of `unit` at `shard` (elements of `esize` bytes):
/// updates write only the elements of parameters, and a reused staging slot would otherwise hold
/// what an earlier unit left there. Padding is zero everywhere (gather buffers, checkpoints).
void zero_padding(const UnitShape& unit, char* shard, size_t esize);

/// The element grain shards are padded to: Config::shard_alignment, or with q8 moments its
/// least common multiple with Config::state_block, so that no quantization block straddles two
/// ranks at any world size.
int64_t padding_grain(const Config& cfg);

/// Packs `params` back to back and pads for `world_size` shards of `alignment`-element grain.
UnitLayout plan_unit(std::string name, const std::vector<Param>& params, int world_size,
                     int64_t alignment);

}  // namespace zeroshard
