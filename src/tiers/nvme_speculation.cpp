// The nvme state tier's speculative step (see nvme_state_tier.hpp): each unit's record read,
// updated and written to the other slot on the tier's thread during backward, what update()
// keeps of it, and how backward's gradient cache and a drop make way.
#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include "base/check.hpp"
#include "kernels/cpu/update_tasks.hpp"
#include "src/tiers/nvme_state_tier.hpp"

namespace zeroshard::offload {

bool NvmeStateTier::matches(int u, const std::vector<cpu::UpdateHyper>& hyper, int64_t step) const {
  const Speculation& sp = spec_[size_t(u)];
  return sp.step == step && same_update(sp.hyper, sp.runs, hyper, ctx_.unit(u).shard_runs);
}

// Unit u's gradient is final and in its cache slot (grad_reduced() just took it).
void NvmeStateTier::speculate(int u, const std::vector<cpu::UpdateHyper>& hyper, int64_t step,
                              void* out) {
  if (spec_.empty()) return;
  Speculation& sp = spec_[size_t(u)];
  if (sp.state != kNone) drop_speculation(u);  // a second hand-over of the unit this step
  sp.out = out ? out : sp.own_out.data();
  ZS_CHECK(sp.out);
  sp.grad = cached_grad(u);
  sp.hyper = hyper;
  sp.step = step;
  sp.runs = ctx_.unit(u).shard_runs;  // the step's may differ (a parameter held): then dropped
  sp.written = false;
  sp.state = kQueued;
  thread_.post([this, u] { run_speculation(u); });
}

// The committed record into a free swap slot, the update there (the gradient read from its
// cache slot, which stays until the state says done), then the write to the other slot, left in
// flight: the next speculation's read and update overlap it.
void NvmeStateTier::run_speculation(int u) {
  Speculation& sp = spec_[size_t(u)];
  int queued = kQueued;
  if (!sp.state.compare_exchange_strong(queued, kRunning)) return;  // dropped meanwhile
  auto finished_reading = [&] {
    {
      std::lock_guard<std::mutex> lock(spec_mu_);
      sp.state = kDone;
    }
    spec_cv_.notify_all();
  };
  int slot = -1;  // held here until its write is in flight
  try {
    while ((slot = swap_pool_.try_acquire()) < 0) reap_spec_write();
    const Unit& w = units_[size_t(u)];  // cur and rec change only while no speculation runs
    const std::string name = "'" + ctx_.unit(u).layout.name + "'";
    char* base = swap_pool_.data(slot);
    std::vector<Piece> ps;
    store_.pieces(w.rec[w.cur], base, &swap_pool_, false, ps);
    auto rd = space_.io().submit(std::move(ps), who() + "speculative read of unit " + name, true);
    space_.io().wait(*rd);
    cpu::UnitUpdate uu = unit_update(u, base, sp.grad, sp.out, sp.step);
    uu.runs = &sp.runs;
    std::vector<cpu::UpdateTask> tasks;
    cpu::append_update_tasks(sp.hyper, uu, tasks);
    cpu::run_update_tasks(arena_, tasks);
    finished_reading();
    wait_unpinned(u, 1 - w.cur);
    ps.clear();
    store_.pieces(w.rec[1 - w.cur], base, &swap_pool_, true, ps);
    spec_writes_.push_back(
        {u, slot,
         space_.io().submit(std::move(ps), who() + "speculative write of unit " + name, true)});
    slot = -1;
  } catch (...) {
    // Speculation is only ahead of time: the step updates the unit as usual.
    if (slot >= 0) swap_pool_.release(slot);
    if (sp.state == kRunning) finished_reading();
    throw;
  }
}

void NvmeStateTier::reap_spec_write() {
  ZS_CHECK(!spec_writes_.empty());
  const SpecWrite wr = std::move(spec_writes_.front());
  spec_writes_.pop_front();
  space_.io().settle(*wr.io);
  spec_[size_t(wr.unit)].written = !wr.io->error();
  swap_pool_.release(wr.slot);
}

void NvmeStateTier::drain_spec_writes() {
  while (!spec_writes_.empty()) reap_spec_write();
}

bool NvmeStateTier::evictable(int u) {
  int queued = kQueued;
  if (spec_[size_t(u)].state.compare_exchange_strong(queued, kNone)) {
    ++dropped_early_;  // counted with the step it was for
    return true;
  }
  return queued != kRunning;
}

void NvmeStateTier::wait_read(int u) {
  std::unique_lock<std::mutex> lock(spec_mu_);
  spec_cv_.wait(lock, [&] { return spec_[size_t(u)].state != kRunning; });
}

void NvmeStateTier::keep_speculation(int u, ParamSink& sink) {
  Speculation& sp = spec_[size_t(u)];
  hand_to_sink(sink, u, sp.own_out, sp.out, size_t(ctx_.shard(u)) * ctx_.pbytes, arena_);
  sink.done(u);
}

void NvmeStateTier::drop_speculation(int only) {
  if (spec_.empty()) return;
  auto chosen = [&](size_t i) { return only < 0 || size_t(only) == i; };
  for (size_t i = 0; i < spec_.size(); ++i) {
    int queued = kQueued;
    if (chosen(i) && spec_[i].state.compare_exchange_strong(queued, kNone)) ++dropped_early_;
  }
  thread_.settle();
  (void)thread_.take_failure();
  drain_spec_writes();
  for (size_t i = 0; i < spec_.size(); ++i) {
    Speculation& sp = spec_[i];
    if (!chosen(i) || sp.state == kNone) continue;
    ++dropped_early_;
    sp.state = kNone;
    sp.written = false;
  }
}

}  // namespace zeroshard::offload
