// Engine: registration, the cross-rank model check, allocation on the tiers, parameter views,
// stage-3 gather/release with prefetch, and gradient buffers.
#include <algorithm>
#include <chrono>
#include <cstring>
#include <new>
#include <set>
#include <sstream>

#include "src/base/check.hpp"
#include "src/engine_impl.hpp"
#include "src/engine_offload.hpp"

namespace zeroshard {

int BufferPool::acquire(int unit) {
  for (size_t i = 0; i < owner.size(); ++i)
    if (owner[i] < 0) {
      owner[i] = unit;
      return int(i);
    }
  return -1;
}

Engine::Impl::Impl(Config c, std::shared_ptr<Communicator> cm)
    : cfg(std::move(c)),
      comm(std::move(cm)),
      scaler(cfg.loss_scale, cfg.dtype == DType::f16 && cfg.loss_scale.static_scale <= 0) {
  cfg.validate();
  if (!comm) ZS_THROW(invalid_argument, "Engine: the communicator is null");
#ifndef ZEROSHARD_HAVE_URING
  if (cfg.offload_optimizer.tier == Tier::nvme || cfg.offload_param.tier == Tier::nvme)
    ZS_THROW(invalid_config,
             "Engine: the nvme tier needs io_uring, and this zeroshard was built without it "
             "(ZEROSHARD_WITH_URING=OFF); use offload device \"cpu\" or \"none\"");
#endif
  rank = comm->rank();
  world = comm->size();
  dev = make_compute(cfg, res);
  host = make_cpu_compute(res);
  comm = dev->adapt(std::move(comm));
  comm->set_timeout(cfg.collective_timeout_s);
  groups.push_back(cfg.optimizer);
  pdt = cfg.dtype;
  pbytes = dtype_size(pdt);
}

Unit& Engine::Impl::unit(UnitId id, const char* call) {
  if (!finalized)
    ZS_THROW(invalid_argument, "rank " << rank << ": " << call << "() before finalize()");
  if (id < 0 || size_t(id) >= units.size())
    ZS_THROW(invalid_argument, "rank " << rank << ": " << call << "(): no unit with id " << id
                                       << " (" << units.size() << " registered)");
  return units[size_t(id)];
}
const Unit& Engine::Impl::unit(UnitId id, const char* call) const {
  return const_cast<Impl*>(this)->unit(id, call);
}

std::string Engine::Impl::where(const Unit& u) const {
  return "rank " + std::to_string(rank) + ", unit '" + u.layout.name + "'";
}

int Engine::Impl::num_states() const {
  switch (cfg.optimizer.kind) {
    case OptimizerKind::adam:
    case OptimizerKind::adamw:
      return 2;
    case OptimizerKind::lion:
      return 1;
    case OptimizerKind::sgd:
      for (const OptimizerOptions& g : groups)
        if (g.momentum != 0) return 1;
      return 0;
  }
  return 0;
}

std::vector<TensorView> Engine::Impl::views(const Unit& u, void* base) const {
  std::vector<TensorView> v;
  for (const ParamSlot& p : u.layout.params)
    v.push_back({static_cast<char*>(base) + size_t(p.offset) * pbytes, p.numel, pdt, dev->device(),
                 dev->device_index()});
  return v;
}

static std::string device_string(Device d, int index) {
  return d == Device::cpu ? std::string("the CPU") : "GPU " + std::to_string(index);
}

// ---- registration and finalize --------------------------------------------------------------

Engine::Engine(Config config, std::shared_ptr<Communicator> comm)
    : impl_(std::make_unique<Impl>(std::move(config), std::move(comm))) {}

Engine::~Engine() {
  if (!impl_) return;
  // In-flight collectives write into buffers this engine owns: let them land first. One that
  // timed out may still complete when a late peer arrives; wait for that a while, too.
  for (Unit& u : impl_->units)
    for (auto* w : {&u.reduction, &u.gather_work})
      if (*w) (*w)->wait_settled(impl_->cfg.collective_timeout_s);
  // So does the device's queued work (updates, uploads). A failure here has nobody to tell.
  try {
    impl_->dev->synchronize();
  } catch (const Error&) {
  }
}

int Engine::add_group(const OptimizerOptions& o) {
  Impl& m = *impl_;
  if (m.finalized)
    ZS_THROW(invalid_argument, "rank " << m.rank << ": add_group() after finalize()");
  if (o.kind != m.cfg.optimizer.kind)
    ZS_THROW(invalid_argument, "rank " << m.rank << ": add_group(): optimizer "
                                       << optimizer_name(o.kind) << " differs from the engine's "
                                       << optimizer_name(m.cfg.optimizer.kind));
  Config probe = m.cfg;
  probe.optimizer = o;
  probe.validate();  // same range checks as group 0
  m.groups.push_back(o);
  return int(m.groups.size()) - 1;
}

UnitId Engine::add_unit(std::string name, std::vector<Param> params) {
  Impl& m = *impl_;
  std::string at = "rank " + std::to_string(m.rank) + ": add_unit('" + name + "')";
  if (m.finalized) ZS_THROW(invalid_argument, at << " after finalize()");
  for (const Unit& u : m.units)
    if (u.layout.name == name) ZS_THROW(invalid_argument, at << ": a unit of that name exists");
  std::set<std::string> names;
  for (const Param& p : params) {
    if (!names.insert(p.name).second)
      ZS_THROW(invalid_argument, at << ": parameter '" << p.name << "' twice");
    for (int64_t d : p.shape)
      if (d < 0)
        ZS_THROW(invalid_argument,
                 at << ": parameter '" << p.name << "' has shape " << shape_string(p.shape));
    if (p.group < 0 || size_t(p.group) >= m.groups.size())
      ZS_THROW(invalid_argument, at << ": parameter '" << p.name << "' names group " << p.group
                                    << " but " << m.groups.size() << " exist");
    if (p.init.data && (p.init.numel != shape_numel(p.shape) || p.init.device != Device::cpu))
      ZS_THROW(invalid_argument, at << ": initial values of '" << p.name << "' have "
                                    << p.init.numel << " elements (need " << shape_numel(p.shape)
                                    << ", on the CPU)");
  }
  Unit u;
  u.layout = plan_unit(name, params, m.world, m.cfg.shard_alignment);
  u.init_params = std::move(params);
  m.units.push_back(std::move(u));
  return UnitId(m.units.size() - 1);
}

// Every rank renders its model and configuration as lines; rank 0's lines are broadcast and
// each rank compares. The lowest rank that differs then broadcasts its finding, so all ranks
// throw the same message. Every rank runs the same collectives whatever it registered: no hang.
void Engine::Impl::check_same_model() {
  std::ostringstream os;
  os << cfg.fingerprint();  // one "config <setting>=<value>" line per setting ranks must share
  for (size_t g = 0; g < groups.size(); ++g)
    os << "group " << g << " lr=" << groups[g].lr << " wd=" << groups[g].weight_decay << "\n";
  for (const Unit& u : units) {
    os << "unit '" << u.layout.name << "'\n";
    for (const ParamSlot& p : u.layout.params)
      os << "  param '" << p.name << "' shape " << shape_string(p.shape) << " dtype "
         << dtype_name(pdt) << " group " << p.group << "\n";
  }
  os << "end\n";
  std::string mine = os.str();
  if (world == 1) return;

  double len = double(mine.size());
  comm->all_reduce(&len, 1, ReduceOp::max, "model check (length)")->wait();
  std::string theirs(size_t(len), '\0');
  if (rank == 0) std::copy(mine.begin(), mine.end(), theirs.begin());
  comm->broadcast(theirs.data(), int64_t(theirs.size()), 0, "model check (rank 0's model)")->wait();
  theirs.resize(theirs.find("end\n") == std::string::npos ? theirs.size()
                                                          : theirs.find("end\n") + 4);

  std::string diff;
  if (mine != theirs) {
    std::istringstream a(theirs), b(mine);
    std::string la, lb, context = "the configuration";
    int line = 1;
    while (true) {
      bool ga = bool(std::getline(a, la)), gb = bool(std::getline(b, lb));
      if (!ga && !gb) break;
      if (!ga) la = "(nothing)";
      if (!gb) lb = "(nothing)";
      if (la != lb) break;
      if (la.rfind("unit ", 0) == 0) context = la;
      ++line;
    }
    diff = "rank " + std::to_string(rank) +
           " registered a different model than rank 0: first difference in " + context +
           ": rank 0 has \"" + la + "\", rank " + std::to_string(rank) + " has \"" + lb + "\"";
  }
  double first = diff.empty() ? double(world) : double(rank);
  comm->all_reduce(&first, 1, ReduceOp::min, "model check (first differing rank)")->wait();
  if (first >= world) return;
  double dlen = double(diff.size());
  comm->all_reduce(&dlen, 1, ReduceOp::max, "model check (message length)")->wait();
  std::string msg(size_t(dlen), ' ');
  if (rank == int(first)) std::copy(diff.begin(), diff.end(), msg.begin());
  comm->broadcast(msg.data(), int64_t(msg.size()), int(first), "model check (message)")->wait();
  while (!msg.empty() && msg.back() == ' ') msg.pop_back();
  ZS_THROW(model_mismatch, "finalize() on rank " << rank << ": " << msg);
}

void Engine::Impl::allocate() {
  const int st = cfg.stage;
  const Tier topt = cfg.offload_optimizer.tier;
  const Tier tpar = st == 3 ? cfg.offload_param.tier : Tier::device;
  const bool pin_opt = cfg.offload_optimizer.pin_memory, pin_par = cfg.offload_param.pin_memory;
  const int k = cfg.gradient_accumulation_steps;
  int64_t largest = 0, largest_shard = 0;
  // Device-tier memory comes from the device's backend; pinned host-tier memory from CUDA when
  // the device is a GPU (so copies are DMA), else from the heap, mlock'ed.
  auto buffer = [&](Tier t, MemKind kind, const char* name, size_t bytes, bool pin) {
    if (t == Tier::device) return Buffer(&ledger, t, kind, name, bytes, dev->device_memory());
    if (pin && dev->pinned_memory())
      return Buffer(&ledger, t, kind, name, bytes, dev->pinned_memory());
    return Buffer(&ledger, t, kind, name, bytes, pin);
  };
  for (Unit& u : units) {
    const UnitLayout& L = u.layout;
    const int64_t ext = st == 0 ? L.padded_numel : L.shard_numel;  // extent of f32 state
    largest = std::max(largest, L.padded_numel);
    largest_shard = std::max(largest_shard, L.shard_numel);
    u.whole_runs = L.runs(0, L.padded_numel);
    u.shard_runs = L.runs(rank * L.shard_numel, (rank + 1) * L.shard_numel);

    // On the nvme tier the shards live in swap files (nvme_setup() below) and the grad shard in
    // the tier's gradient cache; nothing of them is allocated here.
    if (tpar != Tier::nvme) {
      u.param_buf = buffer(tpar, MemKind::param, "param",
                           size_t(st == 3 ? L.shard_numel : L.padded_numel) * pbytes, pin_par);
      u.param = u.param_buf.data();
    }
    if (st < 2) {
      u.grad_buf =
          buffer(Tier::device, MemKind::grad, "grad", size_t(L.padded_numel) * pbytes, false);
      u.grad_whole = u.grad_buf.data();
    }
    if (staged())
      u.param_upload_buf =
          buffer(Tier::host, MemKind::buffer, "param_upload", size_t(L.shard_numel) * pbytes, true);
    if (topt == Tier::nvme) continue;
    if (st < 2)
      u.grad_shard_buf =
          buffer(topt, MemKind::buffer, "grad_shard", size_t(L.shard_numel) * pbytes, pin_opt);
    else
      u.grad_shard_buf =
          buffer(topt, MemKind::grad, "grad", size_t(L.shard_numel) * pbytes, pin_opt);
    u.grad_shard = u.grad_shard_buf.data();
    if (k > 1) {
      u.accum_buf = buffer(topt, MemKind::buffer, "grad_accum", size_t(ext) * 4, pin_opt);
      u.accum = u.accum_buf.as<float>();
    }
    // An f32 model's master weights are its parameters when both live on the same tier.
    bool alias = pdt == DType::f32 && topt == tpar;
    if (alias) {
      u.master = static_cast<float*>(u.param) + (st == 1 || st == 2 ? rank * L.shard_numel : 0);
    } else {
      u.master_buf = buffer(topt, MemKind::master, "master", size_t(ext) * 4, pin_opt);
      u.master = u.master_buf.as<float>();
    }
    int ns = num_states();
    if (ns >= 1) {
      u.state0_buf = buffer(topt, MemKind::optim_state, "state0", size_t(ext) * 4, pin_opt);
      u.state0 = u.state0_buf.as<float>();
    }
    if (ns >= 2) {
      u.state1_buf = buffer(topt, MemKind::optim_state, "state1", size_t(ext) * 4, pin_opt);
      u.state1 = u.state1_buf.as<float>();
    }
  }
  auto make_pool = [&](BufferPool& pool, int count, const char* name, int64_t numel) {
    for (int i = 0; i < count; ++i) {
      pool.buffers.push_back(
          buffer(Tier::device, MemKind::buffer, name, size_t(numel) * pbytes, false));
      pool.owner.push_back(-1);
    }
  };
  if (st >= 2) make_pool(grad_pool, cfg.grad_buffers, "grad_staging", largest);
  if (st == 3) make_pool(gather_pool, cfg.max_live_units, "gather", largest);
  if (staged()) make_pool(shard_pool, cfg.grad_buffers, "grad_shard_staging", largest_shard);
  if (topt == Tier::nvme || tpar == Tier::nvme) nvme_setup();
}

void Engine::Impl::write_params(void* dst, const float* values, int64_t n) {
  if (dev->device() == Device::cpu) {
    host->convert(values, DType::f32, dst, pdt, n);
    return;
  }
  std::vector<char> low(size_t(n) * pbytes);
  host->convert(values, DType::f32, low.data(), pdt, n);
  dev->copy(dst, low.data(), low.size());
  dev->synchronize();
}

// Initial values go through f32 once; the low-precision copy is rounded from the master, so every
// stage starts from bitwise the same state.
void Engine::Impl::load_initial_values() {
  std::vector<float> whole;
  for (Unit& u : units) {
    const UnitLayout& L = u.layout;
    bool any = false;
    for (const Param& p : u.init_params) any |= p.init.data != nullptr;
    if (nv) {
      // Swap files hold nothing yet: every unit's record and shard is written, zeros or not,
      // so that every block on disk has a checksum before it is first read.
      if (any) {
        whole.assign(size_t(L.padded_numel), 0.0f);
        for (size_t i = 0; i < u.init_params.size(); ++i) {
          const TensorView& v = u.init_params[i].init;
          if (v.data)
            cpu::convert(res.isa(), v.data, v.dtype, whole.data() + L.params[i].offset, DType::f32,
                         v.numel);
        }
      }
      nvme_load_initial(int(&u - units.data()), any ? whole.data() : nullptr);
      u.init_params.clear();
      u.init_params.shrink_to_fit();
      continue;
    }
    if (any) {
      whole.assign(size_t(L.padded_numel), 0.0f);
      for (size_t i = 0; i < u.init_params.size(); ++i) {
        const TensorView& v = u.init_params[i].init;
        if (v.data)
          cpu::convert(res.isa(), v.data, v.dtype, whole.data() + L.params[i].offset, DType::f32,
                       v.numel);
      }
      int64_t b = cfg.stage == 0 ? 0 : rank * L.shard_numel;
      int64_t ext = cfg.stage == 0 ? L.padded_numel : L.shard_numel;
      if (!u.master_buf.empty()) {
        opt_compute().copy(u.master, whole.data() + b, size_t(ext) * 4);
        opt_compute().synchronize();  // before `whole` is refilled
      }
      if (cfg.stage == 3)
        write_params(u.param, whole.data() + b, L.shard_numel);
      else
        write_params(u.param, whole.data(), L.padded_numel);
    }
    u.init_params.clear();
    u.init_params.shrink_to_fit();
  }
  if (nv) nvme_finish_load();
}

void Engine::finalize() {
  Impl& m = *impl_;
  if (m.finalized) ZS_THROW(invalid_argument, "rank " << m.rank << ": finalize() called twice");
  if (m.units.empty())
    ZS_THROW(invalid_argument, "rank " << m.rank << ": finalize() with no units registered");
  m.check_same_model();
  if (m.cfg.offload_optimizer.tier == Tier::nvme ||
      (m.cfg.stage == 3 && m.cfg.offload_param.tier == Tier::nvme)) {
    // Swap files can fail on one rank only (a full or read-only path): every rank must then
    // fail here, naming the rank and path, instead of hanging in its first collective.
    std::optional<Error> mine;
    try {
      m.allocate();
      m.load_initial_values();
    } catch (const Error& e) {
      mine = e;
    } catch (const std::bad_alloc&) {
      mine = Error(ErrorCode::no_space,
                   "rank " + std::to_string(m.rank) + ": finalize(): out of host memory");
    } catch (const std::exception& e) {
      mine = Error(ErrorCode::internal,
                   "rank " + std::to_string(m.rank) + ": finalize(): " + e.what());
    }
    if (std::optional<Error> e = m.agree(mine, "finalize()")) {
      m.nv.reset();  // removes the swap directory: a failed finalize() leaves nothing behind
      throw *e;
    }
  } else {
    m.allocate();
    m.load_initial_values();
  }
  m.finalized = true;
  m.interval_start =
      std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// ---- parameters: views, gather, release --------------------------------------------------------

std::vector<TensorView> Engine::params(UnitId id) const {
  const Impl& m = *impl_;
  const Unit& u = m.unit(id, "params");
  if (m.cfg.stage < 3) return m.views(u, u.param);
  if (!u.gathered)
    ZS_THROW(invalid_argument, "params(): " << m.where(u)
                                            << " is not gathered (stage 3 keeps only a "
                                               "shard); call gather() first");
  return m.views(u, m.gather_pool.buffers[size_t(u.gather_slot)].data());
}

int Engine::Impl::take_gather_slot(int id) {
  int slot = gather_pool.acquire(id);
  if (slot >= 0) return slot;
  // Reclaim a prefetched unit the trainer has not asked for yet (same decision on every rank).
  for (size_t i = 0; i < units.size(); ++i) {
    Unit& v = units[i];
    if (v.gather_slot >= 0 && !v.gathered) {
      wait_for(*v.gather_work);
      if (par_nvme()) nvme_param_done(int(i));
      gather_pool.release(v.gather_slot);
      v.gather_slot = -1;
      v.gather_work.reset();
      return gather_pool.acquire(id);
    }
  }
  return -1;
}

void Engine::Impl::start_gather(int id) {
  Unit& u = units[size_t(id)];
  int slot = take_gather_slot(id);
  if (slot < 0)
    ZS_THROW(invalid_argument, "gather(): " << where(u) << ": " << cfg.max_live_units
                                            << " units are already gathered (max_live_units); "
                                               "release() some or raise max_live_units");
  u.gather_slot = slot;
  const void* shard = u.param;
  if (par_nvme()) {
    try {
      shard = nvme_param_source(id);  // collective: every rank fails together if a read failed
    } catch (...) {
      gather_pool.release(slot);
      u.gather_slot = -1;
      throw;
    }
  }
  dev->before_collective();
  u.gather_work =
      track(comm->all_gather(shard, gather_pool.buffers[size_t(slot)].data(), u.layout.shard_numel,
                             pdt, "unit '" + u.layout.name + "'"));
}

void Engine::Impl::prefetch_after(int) {
  if (!cfg.prefetch || !order_recorded || gather_pos >= gather_order.size()) return;
  Unit& next = units[size_t(gather_order[gather_pos])];
  if (next.gather_slot >= 0) return;
  int slot = gather_pool.acquire(gather_order[gather_pos]);
  if (slot < 0) return;  // no free buffer: prefetching must never evict
  gather_pool.release(slot);
  start_gather(gather_order[gather_pos]);
}

std::vector<TensorView> Engine::gather(UnitId id) {
  Impl& m = *impl_;
  Unit& u = m.unit(id, "gather");
  if (m.cfg.stage < 3) return m.views(u, u.param);
  if (u.gathered)
    ZS_THROW(invalid_argument,
             "gather(): " << m.where(u) << " is already gathered; release() it first");
  // Follow the recorded order; after a divergence, resynchronise at the next occurrence.
  if (!m.order_recorded) {
    m.gather_order.push_back(id);
  } else {
    auto it =
        std::find(m.gather_order.begin() + long(std::min(m.gather_pos, m.gather_order.size())),
                  m.gather_order.end(), id);
    if (it != m.gather_order.end()) m.gather_pos = size_t(it - m.gather_order.begin()) + 1;
  }
  if (u.gather_slot < 0) m.start_gather(id);
  m.wait_for(*u.gather_work);
  if (m.par_nvme()) m.nvme_param_done(id);
  u.gathered = true;
  if (m.par_nvme()) {
    // Reads ahead first, so the drive is busy while the prefetch waits for the next shard. The
    // prefetch can fail (on every rank together): then this unit is given back too, so the
    // trainer can simply gather it again.
    m.nvme_param_read_ahead();
    try {
      m.prefetch_after(id);
    } catch (...) {
      u.gathered = false;
      m.gather_pool.release(u.gather_slot);
      u.gather_slot = -1;
      u.gather_work.reset();
      throw;
    }
    m.nvme_param_read_ahead();
  } else {
    m.prefetch_after(id);
  }
  return m.views(u, m.gather_pool.buffers[size_t(u.gather_slot)].data());
}

void Engine::release(UnitId id) {
  Impl& m = *impl_;
  Unit& u = m.unit(id, "release");
  if (m.cfg.stage < 3) return;
  if (!u.gathered) ZS_THROW(invalid_argument, "release(): " << m.where(u) << " is not gathered");
  u.gathered = false;
  m.gather_pool.release(u.gather_slot);
  u.gather_slot = -1;
  u.gather_work.reset();
}

// ---- gradients ---------------------------------------------------------------------------------

std::vector<TensorView> Engine::grads(UnitId id) {
  Impl& m = *impl_;
  Unit& u = m.unit(id, "grads");
  const size_t bytes = size_t(u.layout.padded_numel) * m.pbytes;
  if (u.grads_out)
    return m.views(
        u, m.cfg.stage < 2 ? u.grad_whole : m.grad_pool.buffers[size_t(u.grad_slot)].data());
  m.finish_reduction(id);
  if (u.micro_done >= m.cfg.gradient_accumulation_steps)
    ZS_THROW(invalid_argument,
             "grads(): " << m.where(u) << " already has the gradients of " << u.micro_done
                         << " micro-steps (gradient_accumulation_steps = "
                         << m.cfg.gradient_accumulation_steps << "); call step() first");
  void* base = u.grad_whole;
  if (m.cfg.stage >= 2) {
    int slot = m.grad_pool.acquire(id);
    // All staging buffers busy: the oldest reduction frees one (ranks decide alike).
    for (size_t i = 0; slot < 0 && i < m.grad_pool.owner.size(); ++i) {
      int owner = m.grad_pool.owner[i];
      if (owner >= 0 && m.units[size_t(owner)].reduction) {
        m.finish_reduction(owner);
        slot = m.grad_pool.acquire(id);
      }
    }
    if (slot < 0)
      ZS_THROW(invalid_argument, "grads(): " << m.where(u) << ": all " << m.cfg.grad_buffers
                                             << " gradient buffers hold units not yet marked ready "
                                                "(grad_buffers); call grads_ready() first");
    u.grad_slot = slot;
    base = m.grad_pool.buffers[size_t(slot)].data();
  }
  m.dev->zero(base, bytes);
  u.grads_out = true;
  return m.views(u, base);
}

void Engine::grads_ready(UnitId id, const std::vector<TensorView>& src) {
  Impl& m = *impl_;
  Unit& u = m.unit(id, "grads_ready");
  const auto& ps = u.layout.params;
  if (src.size() != ps.size())
    ZS_THROW(invalid_argument, "grads_ready(): " << m.where(u) << " has " << ps.size()
                                                 << " parameters, got " << src.size()
                                                 << " gradients");
  for (size_t i = 0; i < ps.size(); ++i) {
    const TensorView& g = src[i];
    // The CPU or the engine's own GPU: copies from another GPU would need peer access.
    const bool reachable = g.device == Device::cpu ||
                           (g.device == m.dev->device() && g.device_index == m.dev->device_index());
    if (g.numel != ps[i].numel || g.dtype != m.pdt || !reachable || (!g.data && g.numel))
      ZS_THROW(
          invalid_argument,
          "grads_ready(): "
              << m.where(u) << ": gradient of '" << ps[i].name << "' has " << g.numel
              << " elements of " << dtype_name(g.dtype)
              << (g.device == Device::cpu ? "" : " on " + device_string(g.device, g.device_index))
              << ", expected " << ps[i].numel << " of " << dtype_name(m.pdt) << " on the CPU"
              << (m.dev->device() == Device::cpu
                      ? ""
                      : " or " + device_string(m.dev->device(), m.dev->device_index())));
  }
  std::vector<TensorView> dst = grads(id);
  bool from_host = false;
  for (size_t i = 0; i < ps.size(); ++i) {
    if (src[i].numel) m.dev->copy(dst[i].data, src[i].data, src[i].bytes());
    from_host |= src[i].device == Device::cpu;
  }
  // The caller may reuse its host memory once this returns.
  if (from_host) m.dev->synchronize();
  grads_ready(id);
}

void Engine::grads_ready(UnitId id) {
  Impl& m = *impl_;
  Unit& u = m.unit(id, "grads_ready");
  if (!u.grads_out)
    ZS_THROW(invalid_argument,
             "grads_ready(): " << m.where(u) << " has no gradient buffer out; call grads() first");
  const void* src =
      m.cfg.stage < 2 ? u.grad_whole : m.grad_pool.buffers[size_t(u.grad_slot)].data();
  if (m.opt_nvme()) m.nvme_grad_target(id);  // points u.grad_shard at a slot of the gradient cache
  void* dst = u.grad_shard;
  if (m.staged()) {  // into GPU memory first; finish_reduction() brings it to the host tier
    int slot = m.shard_pool.acquire(id);
    for (size_t i = 0; slot < 0 && i < m.shard_pool.owner.size(); ++i) {
      m.finish_reduction(m.shard_pool.owner[i]);  // the oldest reductions free their slots
      slot = m.shard_pool.acquire(id);
    }
    ZS_CHECK(slot >= 0);
    u.shard_slot = slot;
    dst = m.shard_pool.buffers[size_t(slot)].data();
  }
  m.dev->before_collective();
  try {
    u.reduction = m.track(m.comm->reduce_scatter(src, dst, u.layout.shard_numel, m.pdt,
                                                 "unit '" + u.layout.name + "'"));
  } catch (...) {
    if (u.shard_slot >= 0) m.shard_pool.release(u.shard_slot);
    u.shard_slot = -1;
    throw;
  }
  u.grads_out = false;
  if (!m.cfg.overlap_comm) m.finish_reduction(id);
}

// ---- accessors ---------------------------------------------------------------------------------

void Engine::set_lr(int group, float lr) {
  if (group < 0 || size_t(group) >= impl_->groups.size())
    ZS_THROW(invalid_argument, "set_lr(): no parameter group " << group);
  if (!(lr >= 0)) ZS_THROW(invalid_argument, "set_lr(): lr = " << lr << " must be >= 0");
  impl_->groups[size_t(group)].lr = lr;
}
float Engine::lr(int group) const {
  if (group < 0 || size_t(group) >= impl_->groups.size())
    ZS_THROW(invalid_argument, "lr(): no parameter group " << group);
  return impl_->groups[size_t(group)].lr;
}
float Engine::loss_scale() const {
  return impl_->scaler.scale();
}
int64_t Engine::step_count() const {
  return impl_->steps;
}
int Engine::rank() const {
  return impl_->rank;
}
int Engine::world_size() const {
  return impl_->world;
}
int Engine::num_units() const {
  return int(impl_->units.size());
}
const std::string& Engine::unit_name(UnitId id) const {
  if (id < 0 || size_t(id) >= impl_->units.size())
    ZS_THROW(invalid_argument, "unit_name(): no unit " << id);
  return impl_->units[size_t(id)].layout.name;
}
const Config& Engine::config() const {
  return impl_->cfg;
}
const std::shared_ptr<Communicator>& Engine::communicator() const {
  return impl_->comm;
}
void* Engine::stream() const {
  return impl_->dev->stream();
}
void Engine::set_stream(void* stream) {
  impl_->dev->set_stream(stream);
}

std::vector<Param> Engine::unit_params(UnitId id) const {
  if (id < 0 || size_t(id) >= impl_->units.size())
    ZS_THROW(invalid_argument, "unit_params(): no unit " << id);
  std::vector<Param> out;
  for (const ParamSlot& p : impl_->units[size_t(id)].layout.params)
    out.push_back(Param{p.name, p.shape, p.group});
  return out;
}

bool Engine::has_state(StateKind kind) const {
  int n = impl_->num_states();
  return kind == StateKind::state1 ? n >= 2 : kind == StateKind::state0 ? n >= 1 : true;
}
MemoryReport Engine::memory() const {
  return impl_->ledger.report();
}

ShardInfo Engine::shard_info(UnitId id) const {
  const Impl& m = *impl_;
  if (id < 0 || size_t(id) >= m.units.size())
    ZS_THROW(invalid_argument, "shard_info(): no unit " << id);
  const UnitLayout& L = m.units[size_t(id)].layout;
  return {L.numel, L.padded_numel, m.rank * L.shard_numel, L.shard_numel};
}

std::vector<float> Engine::read_shard(UnitId id, StateKind kind) const {
  const Impl& m = *impl_;
  const Unit& u = m.unit(id, "read_shard");
  const int64_t n = u.layout.shard_numel, off = m.rank * n;
  if ((kind == StateKind::param && m.par_nvme()) || (kind != StateKind::param && m.opt_nvme()))
    return m.nvme_read_state(u, kind);  // from the committed slot on disk
  std::vector<float> out(static_cast<size_t>(n));
  const int64_t f32_off = m.cfg.stage == 0 ? off : 0;  // f32 state is whole only in stage 0
  const float* src = nullptr;
  switch (kind) {
    case StateKind::param: {
      const char* p =
          static_cast<const char*>(u.param) + size_t(m.cfg.stage == 3 ? 0 : off) * m.pbytes;
      std::vector<char> low(size_t(n) * m.pbytes);
      m.dev->copy(low.data(), p, low.size());
      m.dev->synchronize();
      cpu::convert(m.res.isa(), low.data(), m.pdt, out.data(), DType::f32, n);
      return out;
    }
    case StateKind::master:
      src = u.master + f32_off;
      break;
    case StateKind::state0:
      src = u.state0 ? u.state0 + f32_off : nullptr;
      break;
    case StateKind::state1:
      src = u.state1 ? u.state1 + f32_off : nullptr;
      break;
  }
  if (!src)
    ZS_THROW(invalid_argument, "read_shard(): " << m.where(u) << ": optimizer "
                                                << optimizer_name(m.cfg.optimizer.kind)
                                                << " keeps no such state");
  m.opt_compute().copy(out.data(), src, size_t(n) * 4);
  m.opt_compute().synchronize();
  return out;
}

}  // namespace zeroshard

namespace zeroshard {

void Engine::write_shard(UnitId id, StateKind kind, const std::vector<float>& v) {
  Impl& m = *impl_;
  Unit& u = m.unit(id, "write_shard");
  const int64_t n = u.layout.shard_numel;
  if (int64_t(v.size()) != n)
    ZS_THROW(invalid_argument, "write_shard(): " << m.where(u) << ": got " << v.size()
                                                 << " values for a shard of " << n);
  if (m.opt_nvme() && kind != StateKind::param) {
    m.nvme_write_state(u, kind, v);
    return;
  }
  const int64_t off = m.cfg.stage == 0 ? m.rank * n : 0;
  float* dst = kind == StateKind::master   ? u.master + off
               : kind == StateKind::state0 ? (u.state0 ? u.state0 + off : nullptr)
               : kind == StateKind::state1 ? (u.state1 ? u.state1 + off : nullptr)
                                           : nullptr;
  if (!dst)
    ZS_THROW(invalid_argument, "write_shard(): " << m.where(u) << ": no such writable state");
  m.opt_compute().copy(dst, v.data(), size_t(n) * 4);
  m.opt_compute().synchronize();
}

void Engine::commit_shards() {
  Impl& m = *impl_;
  if (!m.finalized)
    ZS_THROW(invalid_argument, "rank " << m.rank << ": commit_shards() before finalize()");
  if (m.nv) {
    m.nvme_commit_shards();
    return;
  }
  std::vector<std::shared_ptr<Work>> works;
  for (Unit& u : m.units) {
    const int64_t n = u.layout.shard_numel, off = m.rank * n;
    const std::string what = "unit '" + u.layout.name + "' (restored state)";
    if (m.cfg.stage == 0) {  // whole f32 state on every rank: gather the restored shards first
      m.dev->before_collective();
      for (float* f : {u.master, u.state0, u.state1})
        if (f) works.push_back(m.comm->all_gather(f + off, f, n, DType::f32, what));
    }
  }
  for (auto& w : works) w->wait();
  works.clear();
  for (Unit& u : m.units) {
    const int64_t n = u.layout.shard_numel;
    const std::string what = "unit '" + u.layout.name + "' (restored parameters)";
    // The parameters are rounded from the master where the master lives.
    const int64_t count = m.cfg.stage == 0 ? u.layout.padded_numel : n;
    if (m.staged()) {
      m.write_params(m.own_param(u), u.master, count);
    } else {
      m.opt_compute().convert(u.master, DType::f32, m.own_param(u), m.pdt, count);
    }
    if (m.cfg.stage == 1 || m.cfg.stage == 2) {
      m.dev->before_collective();
      works.push_back(m.comm->all_gather(m.own_param(u), u.param, n, m.pdt, what));
    }
  }
  for (auto& w : works) w->wait();
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
