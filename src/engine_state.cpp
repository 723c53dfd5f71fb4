// Engine: state access for checkpoints. Shards are read and written where their tier keeps them;
// commit_shards() then rebuilds the low-precision parameters from the restored master weights.
#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>

#include "base/check.hpp"
#include "src/compute/device_communicator.hpp"
#include "src/engine_impl.hpp"

namespace zeroshard {

std::vector<float> Engine::read_shard(UnitId id, StateKind kind) const {
  const Impl& m = *impl_;
  m.unit(id, "read_shard");
  return kind == StateKind::param ? m.params->read(id) : m.state->read(id, kind);
}

void Engine::write_shard(UnitId id, StateKind kind, const std::vector<float>& v) {
  Impl& m = *impl_;
  m.unit(id, "write_shard");
  const int64_t n = m.layout(id).shard_numel;
  if (int64_t(v.size()) != n)
    ZS_THROW(invalid_argument, "write_shard(): " << m.where(id) << ": got " << v.size()
                                                 << " values for a shard of " << n);
  // Parameters are not state: commit_shards() rounds them from the master weights.
  if (kind == StateKind::param)
    ZS_THROW(invalid_argument, "write_shard(): " << m.where(id) << ": no such writable state");
  // What no update could have produced: the state would train on as NaN, or differ per rank
  // where stage 0 keeps the padding of every shard.
  const int64_t real = std::clamp<int64_t>(m.layout(id).numel - m.topo.shard_rank * n, 0, n);
  const bool second_moment =
      kind == StateKind::state1 &&
      (m.cfg.optimizer.kind == OptimizerKind::adam || m.cfg.optimizer.kind == OptimizerKind::adamw);
  for (int64_t i = 0; i < n; ++i) {
    const float x = v[size_t(i)];
    if (i >= real && x != 0.0f)
      ZS_THROW(invalid_argument, "write_shard(): " << m.where(id) << ": value " << i << " = " << x
                                                   << " lies in the padding past the unit's "
                                                   << m.layout(id).numel
                                                   << " elements, which must be 0");
    if (!std::isfinite(x))
      ZS_THROW(invalid_argument, "write_shard(): " << m.where(id) << ": value " << i << " is " << x
                                                   << " (state must be finite)");
    if (second_moment && x < 0)
      ZS_THROW(invalid_argument, "write_shard(): " << m.where(id) << ": value " << i << " = " << x
                                                   << " of Adam's second moment is negative");
  }
  m.before_state_change();
  m.state->write(id, kind, v);
}

void Engine::commit_shards() {
  Impl& m = *impl_;
  if (!m.finalized)
    ZS_THROW(invalid_argument, "rank " << m.rank << ": commit_shards() before finalize()");
  // A stage-3 prefetch holds the parameters from before: it must not survive.
  m.drop_prefetches();
  m.before_state_change();
  m.state->commit(*m.topo.shard_comm, *m.params);
  // No hand_to_trainer() on return: the restored parameters were written with waits, or are
  // all-gathered on the host below (scripts/mutate_waits.py found that wait unneeded).
  if (m.cfg.stage != 1 && m.cfg.stage != 2) return;
  // Stages 1–2 keep whole parameters: each rank contributes its restored shard.
  std::vector<std::shared_ptr<Work>> works;
  m.res.dev->before_collective();
  for (size_t i = 0; i < m.units.size(); ++i)
    works.push_back(m.topo.shard_comm->all_gather(
        m.params->own(int(i)), m.params->whole(int(i)), m.layout(int(i)).shard_numel, m.pdt,
        "unit '" + m.layout(int(i)).name + "' (restored parameters)"));
  for (auto& w : works) m.wait_crossing(*w);
}

// Parameter `param` of unit `id`.
const ParamSlot& Engine::Impl::full_access(UnitId id, int param, const char* call) {
  unit(id, call);
  const auto& ps = layout(id).params;
  if (param < 0 || size_t(param) >= ps.size())
    ZS_THROW(invalid_argument, call << "(): " << where(id) << " has " << ps.size()
                                    << " parameters, no parameter " << param);
  return ps[size_t(param)];
}

// Parameter p of unit `id` out of every rank's shard of the unit (f32, shard_numel values):
// an all-gather over the shard group.
template <class Impl>
static std::vector<float> whole_param(Impl& m, UnitId id, const ParamSlot& p,
                                      const std::vector<float>& shard, const char* call) {
  const int64_t n = m.layout(id).shard_numel;
  std::vector<float> unit(size_t(n) * size_t(m.topo.shard_world));
  m.host_collective(
      *m.topo.shard_comm, Impl::CollectiveOp::all_gather, shard.data(), unit.data(), n,
      std::string(call) + "() of '" + p.name + "' in unit '" + m.layout(id).name + "'", false);
  return {unit.begin() + p.offset, unit.begin() + p.offset + p.numel};
}

std::vector<float> Engine::read_full(UnitId id, int param, StateKind kind) {
  Impl& m = *impl_;
  const ParamSlot& p = m.full_access(id, param, "read_full");
  return whole_param(m, id, p, read_shard(id, kind), "read_full");
}

std::vector<float> Engine::read_full_grad(UnitId id, int param) {
  Impl& m = *impl_;
  const ParamSlot& p = m.full_access(id, param, "read_full_grad");
  m.check_state("read_full_grad");
  m.close_grads();  // every micro-step's reductions landed, on every rank
  std::vector<float> shard = m.state->read_grad(id);
  const float scale = float(m.grad_scale());
  for (float& v : shard) v *= scale;
  return whole_param(m, id, p, shard, "read_full_grad");
}

void Engine::write_full(UnitId id, int param, StateKind kind, const std::vector<float>& values) {
  Impl& m = *impl_;
  const ParamSlot& p = m.full_access(id, param, "write_full");
  if (int64_t(values.size()) != p.numel)
    ZS_THROW(invalid_argument, "write_full(): '" << p.name << "' in " << m.where(id) << " has "
                                                 << p.numel << " elements, got " << values.size());
  // Every rank must pass the same values, or the shards would hold a mix: compared by a hash
  // (its largest and smallest over the ranks).
  uint64_t h = 1469598103934665603ull;
  for (float v : values) h = (h ^ std::bit_cast<uint32_t>(v)) * 1099511628211ull;
  double span[2] = {double(h >> 12), -double(h >> 12)};  // 52 bits: exact in a double
  m.wait_crossing(
      *m.comm->all_reduce(span, 2, ReduceOp::max, "write_full(): values of '" + p.name + "'"));
  if (span[0] != -span[1])
    ZS_THROW(invalid_argument, "write_full(): '" << p.name << "' in " << m.where(id)
                                                 << ": the ranks passed different values");
  std::vector<float> shard = read_shard(id, kind);
  const ShardInfo si = shard_info(id);
  const int64_t lo = std::max(p.offset, si.shard_offset);
  const int64_t hi = std::min(p.offset + p.numel, si.shard_offset + si.shard_numel);
  for (int64_t i = lo; i < hi; ++i)
    shard[size_t(i - si.shard_offset)] = values[size_t(i - p.offset)];
  write_shard(id, kind, shard);
  commit_shards();
}

void Engine::set_step_count(int64_t steps) {
  if (steps < 0) ZS_THROW(invalid_argument, "set_step_count(): " << steps << " < 0");
  impl_->steps = steps;
}

void Engine::set_loss_scale(float scale) {
  if (!(scale > 0)) ZS_THROW(invalid_argument, "set_loss_scale(): " << scale << " must be > 0");
  impl_->scaler.set_scale(scale);
}

}  // namespace zeroshard
