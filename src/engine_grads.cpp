// Engine: gradients. The trainer's gradient buffers, the reduce-scatter of each unit as its
// gradients are ready (overlapping the rest of backward), and the hand-over of the reduced shard
// to the state tier.
#include "src/base/check.hpp"
#include "src/engine_impl.hpp"

namespace zeroshard {

namespace {
std::string device_string(Device d, int index) {
  return d == Device::cpu ? std::string("the CPU") : "GPU " + std::to_string(index);
}
}  // namespace

void* Engine::Impl::grad_buffer(int id) const {
  const Unit& u = units[size_t(id)];
  return cfg.stage < 2 ? u.grad_buf.data() : res.grad_staging.data(u.grad_slot);
}

// Waits for a unit's reduce-scatter, completes stage 0's all-reduce (reduce-scatter + all-gather
// over the same shards, so every stage sees bitwise the same reduced gradient), and hands the
// micro-step to the state tier.
void Engine::Impl::finish_reduction(int id) {
  Unit& u = units[size_t(id)];
  if (!u.reduction) return;
  // On failure the handle stays, so the destructor can wait for it to settle.
  wait_for(*u.reduction);
  u.reduction.reset();
  const UnitLayout& L = layout(id);
  if (cfg.stage == 0) {
    res.dev->before_collective();
    wait_for(*track(comm->all_gather(u.reduced, u.grad_buf.data(), L.shard_numel, pdt,
                                     "unit '" + L.name + "' (gradients)")));
  }
  if (u.grad_slot >= 0) {
    res.grad_staging.release(u.grad_slot);
    u.grad_slot = -1;
  }
  state->grad_reduced(id, u.micro_done, cfg.stage == 0 ? u.grad_buf.data() : nullptr);
  ++u.micro_done;
}

std::vector<TensorView> Engine::grads(UnitId id) {
  Impl& m = *impl_;
  Unit& u = m.unit(id, "grads");
  const size_t bytes = size_t(m.layout(id).padded_numel) * m.pbytes;
  if (u.grads_out) return m.views(id, m.grad_buffer(id));
  m.finish_reduction(id);
  if (u.micro_done >= m.cfg.gradient_accumulation_steps)
    ZS_THROW(invalid_argument,
             "grads(): " << m.where(id) << " already has the gradients of " << u.micro_done
                         << " micro-steps (gradient_accumulation_steps = "
                         << m.cfg.gradient_accumulation_steps << "); call step() first");
  if (m.cfg.stage >= 2) {
    BufferPool& pool = m.res.grad_staging;
    int slot = pool.acquire(id);
    // All staging buffers busy: the oldest reduction frees one (ranks decide alike).
    for (size_t i = 0; slot < 0 && i < pool.owner.size(); ++i) {
      int owner = pool.owner[i];
      if (owner >= 0 && m.units[size_t(owner)].reduction) {
        m.finish_reduction(owner);
        slot = pool.acquire(id);
      }
    }
    if (slot < 0)
      ZS_THROW(invalid_argument, "grads(): " << m.where(id) << ": all " << m.cfg.grad_buffers
                                             << " gradient buffers hold units not yet marked ready "
                                                "(grad_buffers); call grads_ready() first");
    u.grad_slot = slot;
  }
  m.res.dev->zero(m.grad_buffer(id), bytes);
  u.grads_out = true;
  return m.views(id, m.grad_buffer(id));
}

void Engine::grads_ready(UnitId id, const std::vector<TensorView>& src) {
  Impl& m = *impl_;
  m.unit(id, "grads_ready");
  const auto& ps = m.layout(id).params;
  const Compute& dev = *m.res.dev;
  if (src.size() != ps.size())
    ZS_THROW(invalid_argument, "grads_ready(): " << m.where(id) << " has " << ps.size()
                                                 << " parameters, got " << src.size()
                                                 << " gradients");
  for (size_t i = 0; i < ps.size(); ++i) {
    const TensorView& g = src[i];
    // The CPU or the engine's own GPU: copies from another GPU would need peer access.
    const bool reachable = g.device == Device::cpu ||
                           (g.device == dev.device() && g.device_index == dev.device_index());
    if (g.numel != ps[i].numel || g.dtype != m.pdt || !reachable || (!g.data && g.numel))
      ZS_THROW(
          invalid_argument,
          "grads_ready(): " << m.where(id) << ": gradient of '" << ps[i].name << "' has " << g.numel
                            << " elements of " << dtype_name(g.dtype)
                            << (g.device == Device::cpu
                                    ? ""
                                    : " on " + device_string(g.device, g.device_index))
                            << ", expected " << ps[i].numel << " of " << dtype_name(m.pdt)
                            << " on the CPU"
                            << (dev.device() == Device::cpu
                                    ? ""
                                    : " or " + device_string(dev.device(), dev.device_index())));
  }
  std::vector<TensorView> dst = grads(id);
  bool from_host = false;
  for (size_t i = 0; i < ps.size(); ++i) {
    if (src[i].numel) m.res.dev->copy(dst[i].data, src[i].data, src[i].bytes());
    from_host |= src[i].device == Device::cpu;
  }
  // The caller may reuse its host memory once this returns.
  if (from_host) m.res.dev->synchronize();
  grads_ready(id);
}

void Engine::grads_ready(UnitId id) {
  Impl& m = *impl_;
  Unit& u = m.unit(id, "grads_ready");
  if (!u.grads_out)
    ZS_THROW(invalid_argument,
             "grads_ready(): " << m.where(id) << " has no gradient buffer out; call grads() first");
  u.reduced = m.state->grad_target(id);
  m.res.dev->before_collective();
  try {
    u.reduction =
        m.track(m.comm->reduce_scatter(m.grad_buffer(id), u.reduced, m.layout(id).shard_numel,
                                       m.pdt, "unit '" + m.layout(id).name + "'"));
  } catch (...) {
    m.state->grad_abandoned(id);  // the collective never started: its target is free again
    throw;
  }
  u.grads_out = false;
  if (!m.cfg.overlap_comm) m.finish_reduction(id);
}

void Engine::zero_grad() {
  Impl& m = *impl_;
  if (!m.finalized) return;  // nothing to forget yet (or a failed finalize() left no tiers)
  for (size_t i = 0; i < m.units.size(); ++i) {
    m.finish_reduction(int(i));
    Unit& u = m.units[i];
    if (u.grad_slot >= 0) m.res.grad_staging.release(u.grad_slot);
    u.grad_slot = -1;
    u.grads_out = false;
    u.micro_done = 0;
  }
  m.state->forget_grads();
}

}  // namespace zeroshard
