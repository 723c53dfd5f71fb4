// GPU parameters with a CPU optimizer (see staged_state_tier.hpp).
#include "src/tiers/staged_state_tier.hpp"

#include "base/check.hpp"

namespace zeroshard {

// The inner tier's update writes each unit's shard to its pinned upload buffer (`set` of the
// two a speculating tier keeps, else the one); done() sends it up to where the parameters live
// on the GPU, on the device's stream.
class StagedStateTier::Uploads final : public ParamSink {
 public:
  Uploads(StagedStateTier& t, ParamSink& gpu, int set) : t_(t), gpu_(gpu), set_(set) {}
  void* target(int u) override { return t_.upload_[size_t(set_)][size_t(u)].data(); }
  void done(int u) override {
    const Buffer& b = t_.upload_[size_t(set_)][size_t(u)];
    t_.dev_.copy(gpu_.target(u), b.data(), b.bytes());
    t_.uploads_pending_ = true;
    gpu_.done(u);
  }
  bool per_unit() const override { return true; }
  void restore(int u, const float* master) override {
    t_.wait_uploads();  // the failed step's uploads, first
    gpu_.restore(u, master);
  }

 private:
  StagedStateTier& t_;
  ParamSink& gpu_;
  int set_;
};

StagedStateTier::StagedStateTier(const TierContext& ctx, std::unique_ptr<StateTier> inner,
                                 Compute& dev, bool params_on_device)
    : ctx_(ctx),
      inner_(std::move(inner)),
      dev_(dev),
      slot_of_(ctx.units->size(), -1),
      host_target_(ctx.units->size(), nullptr),
      params_on_device_(params_on_device) {
  int64_t largest_shard = 0;
  // A speculating inner tier writes the next update's shards during backward, while the last
  // update's may still be going up: two sets of upload buffers, taken in turn (upload_set()).
  const int sets = params_on_device ? (inner_->speculates() ? 2 : 1) : 0;
  for (size_t i = 0; i < ctx.units->size(); ++i) {
    largest_shard = std::max(largest_shard, ctx.shard(int(i)));
    for (int k = 0; k < sets; ++k)
      upload_[k].push_back(ctx.buffer(Tier::host, MemKind::buffer,
                                      k ? "param_upload_speculative" : "param_upload",
                                      size_t(ctx.shard(int(i))) * ctx.pbytes, true));
  }
  slots_.fill(ctx.cfg->grad_buffers, [&] {
    return ctx.buffer(Tier::device, MemKind::buffer, "grad_shard_staging",
                      size_t(largest_shard) * ctx.pbytes, false);
  });
}

void* StagedStateTier::grad_target(int u) {
  host_target_[size_t(u)] = inner_->grad_target(u);
  int slot = slots_.acquire(u);
  for (size_t i = 0; slot < 0 && i < slots_.owner.size(); ++i) {
    ctx_.finish_reduction(slots_.owner[i]);  // the oldest reductions free their slots
    slot = slots_.acquire(u);
  }
  ZS_CHECK(slot >= 0);
  slot_of_[size_t(u)] = slot;
  return slots_.buffers[size_t(slot)].data();
}

void StagedStateTier::grad_reduced(int u, int micro, const void* whole) {
  const int slot = slot_of_[size_t(u)];
  ZS_CHECK(slot >= 0);
  dev_.download(host_target_[size_t(u)], slots_.buffers[size_t(slot)].data(),
                size_t(ctx_.shard(u)) * ctx_.pbytes);
  slots_.release(slot);
  slot_of_[size_t(u)] = -1;
  inner_->grad_reduced(u, micro, whole);
}

void StagedStateTier::grad_abandoned(int u) {
  if (slot_of_[size_t(u)] >= 0) slots_.release(slot_of_[size_t(u)]);
  slot_of_[size_t(u)] = -1;
  inner_->grad_abandoned(u);
}

void StagedStateTier::forget_grads() {
  for (int& slot : slot_of_) {
    if (slot >= 0) slots_.release(slot);
    slot = -1;
  }
  inner_->forget_grads();
}

void StagedStateTier::wait_uploads() {
  if (!uploads_pending_) return;
  dev_.synchronize();
  uploads_pending_ = false;
}

void StagedStateTier::update(const std::vector<cpu::UpdateHyper>& hyper, int64_t step,
                             ParamSink& sink) {
  wait_uploads();
  if (!params_on_device_) return inner_->update(hyper, step, sink);
  const int set = upload_set();
  last_set_ = set;
  Uploads up(*this, sink, set);
  inner_->update(hyper, step, up);
}

// The gradient came down in grad_reduced(), so the inner tier speculates on the host, writing
// the new shard straight into the upload buffer the next update() sends: the update before
// last went up from it, and the last update() waited for that (wait_uploads()).
void StagedStateTier::speculate(int u, const std::vector<cpu::UpdateHyper>& hyper, int64_t step,
                                void*) {
  inner_->speculate(u, hyper, step,
                    params_on_device_ ? upload_[size_t(upload_set())][size_t(u)].data() : nullptr);
}

void StagedStateTier::commit(Communicator& comm, ParamSink& sink) {
  wait_uploads();
  if (!params_on_device_) return inner_->commit(comm, sink);
  Uploads up(*this, sink, 0);  // waited for below, as the last step's were above
  inner_->commit(comm, up);
  wait_uploads();  // restore is off the step path: the parameters are in place on return
}

}  // namespace zeroshard
