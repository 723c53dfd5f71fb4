// Engine: parameters. Views of the whole parameters (stages 0–2); stage 3's gather/release, with
// a prefetch of the next unit in the order recorded during the first step.
#include <algorithm>

#include "base/check.hpp"
#include "src/engine_impl.hpp"

namespace zeroshard {

std::vector<TensorView> Engine::params(UnitId id) const {
  const Impl& m = *impl_;
  const Unit& u = m.unit(id, "params");
  if (m.cfg.stage < 3) return m.views(id, m.params->whole(id));
  if (!u.gathered)
    ZS_THROW(invalid_argument, "params(): " << m.where(id)
                                            << " is not gathered (stage 3 keeps only a "
                                               "shard); call gather() first");
  return m.views(id, m.res.gather.data(u.gather_slot));
}

void Engine::Impl::free_gather(int id) {
  Unit& u = units[size_t(id)];
  res.gather.release(u.gather_slot);
  u.gather_slot = -1;
  u.gather_work.reset();
  params->released(id);
}

int Engine::Impl::take_gather_slot(int id) {
  int slot = res.gather.acquire(id);
  if (slot >= 0) return slot;
  // Reclaim a prefetched unit the trainer has not asked for yet (same decision on every rank).
  for (size_t i = 0; i < units.size(); ++i) {
    Unit& v = units[i];
    if (v.gather_slot >= 0 && !v.gathered) {
      wait_for(*v.gather_work);
      params->gathered(int(i));
      free_gather(int(i));
      return res.gather.acquire(id);
    }
  }
  return -1;
}

// The parameter tier's source of the all-gather. When its staging is full, a prefetched gather
// in flight holds some: let one land, and ask again.
const void* Engine::Impl::gather_source(int id) {
  if (const void* src = params->gather_source(id)) return src;
  std::vector<bool> landed(units.size(), false);
  for (;;) {
    bool freed = false;
    for (size_t v = 0; v < units.size() && !freed; ++v) {
      Unit& w = units[v];
      if (int(v) != id && w.gather_work && !w.gathered && !landed[v]) {
        wait_for(*w.gather_work);
        params->gathered(int(v));
        landed[v] = freed = true;
      }
    }
    ZS_CHECK(freed);
    if (const void* src = params->gather_source(id)) return src;
  }
}

void Engine::Impl::start_gather(int id) {
  Unit& u = units[size_t(id)];
  int slot = take_gather_slot(id);
  if (slot < 0)
    ZS_THROW(invalid_argument, "gather(): " << where(id) << ": " << cfg.max_live_units
                                            << " units are already gathered (max_live_units); "
                                               "release() some or raise max_live_units");
  u.gather_slot = slot;
  const void* shard = nullptr;
  try {
    shard = gather_source(id);  // may be collective: every rank fails together if a read failed
  } catch (...) {
    free_gather(id);
    throw;
  }
  try {
    res.dev->before_collective();
    u.gather_work =
        track(topo.shard_comm->all_gather(shard, res.gather.data(slot), layout(id).shard_numel, pdt,
                                          "unit '" + layout(id).name + "'"));
  } catch (...) {
    free_gather(id);  // no collective holds the buffer or the tier's source
    throw;
  }
  record('a', id);
  count_sent(false, group_ring_bytes(id));
}

void Engine::Impl::prefetch_after(int) {
  if (!cfg.prefetch || !schedule.recorded || schedule.pos >= schedule.order.size()) return;
  const int next = schedule.order[schedule.pos];
  if (units[size_t(next)].gather_slot >= 0) return;
  int slot = res.gather.acquire(next);
  if (slot < 0) return;  // no free buffer: prefetching must never evict
  res.gather.release(slot);
  start_gather(next);
}

std::vector<TensorView> Engine::gather(UnitId id) {
  Impl& m = *impl_;
  Unit& u = m.unit(id, "gather");
  m.check_state("gather");
  if (m.cfg.stage < 3) return m.views(id, m.params->whole(id));
  if (u.gathered)
    ZS_THROW(invalid_argument,
             "gather(): " << m.where(id) << " is already gathered; release() it first");
  // Follow the recorded order; after a divergence, resynchronise at the next occurrence.
  if (!m.schedule.recorded) {
    m.schedule.order.push_back(id);
  } else {
    auto it = std::find(
        m.schedule.order.begin() + long(std::min(m.schedule.pos, m.schedule.order.size())),
        m.schedule.order.end(), id);
    if (it != m.schedule.order.end()) m.schedule.pos = size_t(it - m.schedule.order.begin()) + 1;
  }
  if (u.gather_slot < 0) m.start_gather(id);
  m.wait_for(*u.gather_work);
  m.params->gathered(id);
  u.gathered = true;
  // Reads ahead first, so a drive is busy while the prefetch waits for the next shard. The
  // prefetch can fail (on every rank together): then this unit is given back too, so the
  // trainer can simply gather it again.
  const bool ahead = m.cfg.prefetch && m.schedule.recorded;
  if (ahead) m.params->read_ahead(m.schedule.order, m.schedule.pos);
  try {
    m.prefetch_after(id);
  } catch (...) {
    u.gathered = false;
    m.free_gather(id);
    throw;
  }
  // No hand_to_trainer(): the gather was waited for above, and a host collective's result is in
  // place when its wait returns (scripts/mutate_waits.py found the wait here unneeded).
  if (ahead) m.params->read_ahead(m.schedule.order, m.schedule.pos);
  return m.views(id, m.res.gather.data(u.gather_slot));
}

void Engine::release(UnitId id) {
  Impl& m = *impl_;
  Unit& u = m.unit(id, "release");
  if (m.cfg.stage < 3) return;
  if (!u.gathered) ZS_THROW(invalid_argument, "release(): " << m.where(id) << " is not gathered");
  u.gathered = false;
  m.free_gather(id);
}

}  // namespace zeroshard
