// Stage 3's parameter shards off the GPU (see staged_param_tier.hpp).
#include "src/tiers/staged_param_tier.hpp"

#include <algorithm>

#include "base/check.hpp"

namespace zeroshard {

StagedParamTier::StagedParamTier(const TierContext& ctx, std::unique_ptr<ParamTier> inner,
                                 Compute& dev)
    : ctx_(ctx), inner_(std::move(inner)), dev_(dev), slot_of_(ctx.units->size(), -1) {
  ZS_CHECK(ctx.cfg->stage == 3);
  int64_t largest = 0;
  for (size_t i = 0; i < ctx.units->size(); ++i) largest = std::max(largest, ctx.shard(int(i)));
  // One slot for the gather the trainer waits on, one for the prefetch of the next unit: a
  // third gather in flight waits for one of them (the engine's gather_source() protocol).
  slots_.fill(2, [&] {
    return ctx.buffer(Tier::device, MemKind::buffer, "param_shard_staging",
                      size_t(largest) * ctx.pbytes, false);
  });
}

// The inner tier's shard (host memory, or pinned staging it read from disk) goes up on the
// device's stream, which the all-gather follows (Compute::before_collective()).
const void* StagedParamTier::gather_source(int u) {
  int& slot = slot_of_[size_t(u)];
  if (slot < 0) {
    slot = slots_.acquire(u);
    if (slot < 0) return nullptr;  // both slots feed gathers in flight: one must land first
  }
  const void* src = inner_->gather_source(u);
  if (!src) {
    free_slot(u);
    return nullptr;
  }
  dev_.copy(slots_.data(slot), src, size_t(ctx_.shard(u)) * ctx_.pbytes);
  return slots_.data(slot);
}

void StagedParamTier::free_slot(int u) {
  int& slot = slot_of_[size_t(u)];
  if (slot >= 0) slots_.release(slot);
  slot = -1;
}

// The all-gather finished: it read the slot, and the copy into the slot had read the inner
// tier's source before it.
void StagedParamTier::gathered(int u) {
  free_slot(u);
  inner_->gathered(u);
}

// A dropped prefetch ends here without gathered(): its slot comes back too.
void StagedParamTier::released(int u) {
  free_slot(u);
  inner_->released(u);
}

}  // namespace zeroshard
