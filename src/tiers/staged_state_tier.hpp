#pragma once
// GPU parameters with a CPU optimizer: the host or nvme tier under an engine on a GPU. The
// reduce-scatter fills a GPU staging slot; the reduced shard comes down to the inner tier's
// host memory once it is final (during backward, as the slots cycle); the CPU updates; and each
// unit's new low-precision shard goes up while the next unit updates, unless the parameters
// live off the GPU too (stage 3's offload_param: the update writes them where they are).

#include <memory>
#include <vector>

#include "base/buffer_pool.hpp"
#include "base/ledger.hpp"
#include "src/compute/compute.hpp"
#include "src/tiers/tier.hpp"

namespace zeroshard {

class StagedStateTier final : public StateTier {
 public:
  /// `inner` keeps the state in host memory (or on disk through it); `dev` is the GPU's
  /// backend; the grad_buffers staging slots of the largest shard come from `ctx.buffer`.
  /// `params_on_device`: the parameter shards the update writes are in GPU memory (upload
  /// buffers in pinned memory carry them up), else in host memory or on disk.
  StagedStateTier(const TierContext& ctx, std::unique_ptr<StateTier> inner, Compute& dev,
                  bool params_on_device);
  /// The inner tier first: its speculation thread may be writing an upload buffer.
  ~StagedStateTier() override { inner_.reset(); }

  void load_initial(int u, const float* whole) override { inner_->load_initial(u, whole); }
  void finish_load() override { inner_->finish_load(); }
  void* grad_target(int u) override;
  void grad_reduced(int u, int micro, const void* whole) override;
  void grad_abandoned(int u) override;
  std::optional<Error> settle_grads() override { return inner_->settle_grads(); }
  double sum_squares() override { return inner_->sum_squares(); }
  void forget_grads() override;
  void update(const std::vector<cpu::UpdateHyper>& hyper, int64_t step, ParamSink& sink) override;
  bool speculates() const override { return inner_->speculates(); }
  void speculate(int u, const std::vector<cpu::UpdateHyper>& hyper, int64_t step,
                 void* out) override;
  SpeculationCount speculated() const override { return inner_->speculated(); }
  void preview(const std::vector<cpu::UpdateHyper>& hyper, int64_t step, int u,
               void* out) override {
    inner_->preview(hyper, step, u, out);
  }
  std::vector<float> read(int u, StateKind kind) const override { return inner_->read(u, kind); }
  std::vector<float> read_grad(int u) override { return inner_->read_grad(u); }
  StoredShard stored(int u, StateKind kind) override { return inner_->stored(u, kind); }
  std::unique_ptr<StateSnapshot> snapshot() override { return inner_->snapshot(); }
  void write(int u, StateKind kind, const std::vector<float>& shard) override {
    inner_->write(u, kind, shard);
  }
  void commit(Communicator& comm, ParamSink& sink) override;
  std::vector<std::pair<void*, size_t>> dma_regions() const override {
    return inner_->dma_regions();
  }

 private:
  class Uploads;  // the ParamSink the inner tier updates through
  /// The last step's uploads must land before the update rewrites their buffers.
  void wait_uploads();

  TierContext ctx_;
  std::unique_ptr<StateTier> inner_;
  Compute& dev_;
  BufferPool slots_;                // reduce-scatter outputs on the GPU
  std::vector<int> slot_of_;        // unit → slot in use, or -1
  std::vector<void*> host_target_;  // unit → the inner tier's grad_target()
  std::vector<Buffer> upload_[2];   // unit → its new low-precision shard on its way up
  /// The set of upload buffers the next update() writes (and its speculation): the one the
  /// last update() did not (its uploads may still run; the one before's it waited for).
  int upload_set() const { return upload_[1].empty() ? 0 : 1 - last_set_; }
  int last_set_ = 1;
  bool uploads_pending_ = false;
  bool params_on_device_;
};

}  // namespace zeroshard
