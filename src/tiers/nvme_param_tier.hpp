#pragma once
// Stage 3's parameter shards on nvme (offload_param = nvme, a CPU engine): each unit's
// low-precision shard has two slots in the parameter swap file. gather() reads the committed
// slot into a pinned staging slot (ahead, in the recorded gather order) and all-gathers from
// there; a step writes the new shard to the other slot and flips the slot once every rank wrote
// every shard, so a failed step leaves the last committed parameters on disk.

#include <deque>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "base/ledger.hpp"
#include "kernels/cpu/arena.hpp"
#include "offload/pinned_pool.hpp"
#include "offload/swap_space.hpp"
#include "offload/swap_store.hpp"
#include "src/tiers/initial_writes.hpp"
#include "src/tiers/tier.hpp"

namespace zeroshard::offload {

class NvmeParamTier final : public ParamTier {
 public:
  /// `state_in_memory`: the optimizer state is not on nvme, so a step stores the new shards
  /// (from StateTier::preview()) before the state changes; else the nvme state tier writes
  /// them beside its records (takes_writes()). Registers its file and pool with `space`.
  NvmeParamTier(const TierContext& ctx, cpu::Arena& arena, SwapSpace& space, bool state_in_memory);

  void load_initial(int u, const float* whole) override;
  void finish_load() override;
  void* whole(int) override { return nullptr; }
  void* own(int) override { return nullptr; }
  const void* gather_source(int u) override;
  void gathered(int u) override;
  void released(int u) override { units_[size_t(u)].held = false; }
  void read_ahead(const std::vector<int>& order, size_t pos) override;
  void drop_reads() override;
  void update(StateTier& state, const std::vector<cpu::UpdateHyper>& hyper, int64_t step) override;
  bool previews() const override { return state_in_memory_; }
  bool takes_writes() const override { return !state_in_memory_; }
  std::shared_ptr<IoBatch> write(int u, char* data, const PinnedPool* pool, int64_t step) override;
  void commit_writes() override;
  std::vector<float> read(int u) const override;
  void restore(int u, const float* master) override;
  /// The staging pool: a GPU engine copies shards up from it.
  std::vector<std::pair<void*, size_t>> dma_regions() const override;

 private:
  struct Unit {
    int slot[2] = {-1, -1};  // extents of the two slots
    int cur = 0;             // committed slot
    int pslot = -1;          // param_pool slot with this unit's shard (read or being read)
    std::shared_ptr<IoBatch> pread;
    bool held = false;  // the engine holds a gather buffer of this unit (gathered or prefetched)
  };
  std::shared_ptr<IoBatch> read_into(int u, int slot, const std::string& why);
  /// Computes (through `compute(u, out)`) and stores every unit's new shard without making it
  /// current; throws, on every rank, when one could not be stored. Then commit_writes().
  void store_update(int64_t step, const std::function<void(int u, void* out)>& compute);
  std::string who() const;  // "rank 1: nvme swap "

  TierContext ctx_;
  cpu::Arena& arena_;
  SwapSpace& space_;
  bool state_in_memory_;
  mutable SwapStore store_;  // mutable: reads in const methods take its pieces too
  PinnedPool pool_;          // shards on their way to an all-gather or to disk
  std::vector<Unit> units_;
  InitialWrites init_writes_{pool_};  // finalize()'s writes
  std::vector<std::unique_ptr<DiskCharge>> charges_;
};

}  // namespace zeroshard::offload
