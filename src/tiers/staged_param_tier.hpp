#pragma once
// Stage 3's parameter shards off the GPU (offload_param cpu or nvme under an engine on a GPU:
// ZeRO-Infinity's parameter tier). The inner tier keeps each rank's shard in host memory or on
// disk, as on the CPU engine; a gather reads it there (from disk into pinned staging, ahead of
// the recorded order), copies it up into one of two GPU staging slots on the device's stream,
// and all-gathers from that slot into the unit's gather buffer. The optimizer, on the CPU,
// writes the new shards straight into the inner tier: nothing goes up after the update.

#include <memory>
#include <vector>

#include "base/buffer_pool.hpp"
#include "src/compute/compute.hpp"
#include "src/tiers/tier.hpp"

namespace zeroshard {

class StagedParamTier final : public ParamTier {
 public:
  /// `inner` keeps the shards in host memory or on disk; `dev` is the GPU's backend; the two
  /// staging slots (of the largest shard) come from `ctx.buffer` on the device tier.
  StagedParamTier(const TierContext& ctx, std::unique_ptr<ParamTier> inner, Compute& dev);

  void load_initial(int u, const float* whole) override { inner_->load_initial(u, whole); }
  void finish_load() override { inner_->finish_load(); }
  void* whole(int) override { return nullptr; }  // stage 3 only
  void* own(int u) override { return inner_->own(u); }
  const void* gather_source(int u) override;
  void gathered(int u) override;
  void released(int u) override;
  void read_ahead(const std::vector<int>& order, size_t pos) override {
    inner_->read_ahead(order, pos);
  }
  void drop_reads() override { inner_->drop_reads(); }
  // The update's route is the inner tier's: the CPU optimizer writes the shards where it keeps
  // them.
  void update(StateTier& state, const std::vector<cpu::UpdateHyper>& hyper, int64_t step) override {
    inner_->update(state, hyper, step);
  }
  bool previews() const override { return inner_->previews(); }
  std::optional<float*> share_as_master(int u) override { return inner_->share_as_master(u); }
  void* target(int u) override { return inner_->target(u); }
  void done(int u) override { inner_->done(u); }
  bool takes_writes() const override { return inner_->takes_writes(); }
  std::shared_ptr<offload::IoBatch> write(int u, char* data, const offload::PinnedPool* pool,
                                          int64_t step) override {
    return inner_->write(u, data, pool, step);
  }
  void commit_writes() override { inner_->commit_writes(); }
  std::vector<float> read(int u) const override { return inner_->read(u); }
  void restore(int u, const float* master) override { inner_->restore(u, master); }
  std::vector<std::pair<void*, size_t>> dma_regions() const override {
    return inner_->dma_regions();
  }

 private:
  void free_slot(int u);

  TierContext ctx_;
  std::unique_ptr<ParamTier> inner_;
  Compute& dev_;
  BufferPool slots_;          // shards on the GPU, each the source of one all-gather in flight
  std::vector<int> slot_of_;  // unit → its slot, or -1
};

}  // namespace zeroshard
