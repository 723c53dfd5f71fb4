#pragma once
// The low-precision parameters in memory: every unit whole in the device's memory (stages 0–2),
// or this rank's shard on the device or host tier (stage 3, offload_param none or cpu).

#include <vector>

#include "base/ledger.hpp"
#include "src/compute/compute.hpp"
#include "src/tiers/tier.hpp"

namespace zeroshard {

class MemoryParamTier final : public ParamTier {
 public:
  /// `tier`: where stage 3's shards live (device or host); `dev` is the engine's device and
  /// `host` the CPU's backend (for rounding f32 values on their way in).
  MemoryParamTier(const TierContext& ctx, Tier tier, Compute& dev, Compute& host);

  void load_initial(int u, const float* whole) override;
  void* whole(int u) override;
  void* own(int u) override;
  std::vector<float> read(int u) const override;
  void restore(int u, const float* master) override;
  std::optional<float*> share_as_master(int u) override;
  void* target(int u) override { return shared_[size_t(u)] ? nullptr : own(u); }
  bool adopt(int u, Buffer& values) override;

 private:
  /// n low-precision values at dst (device memory) rounded from f32 values in host memory;
  /// returns once `values` may be reused. Off the step path (set-up, restore).
  void write(void* dst, const float* values, int64_t n);

  TierContext ctx_;
  Compute& dev_;
  Compute& host_;
  std::vector<Buffer> params_;  // per unit: whole (stages 0–2) or this rank's shard (stage 3)
  std::vector<bool> shared_;    // per unit: its f32 parameters are the master weights
};

}  // namespace zeroshard
