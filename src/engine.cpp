// Engine: construction, registration of units and groups, and the accessors of the public API.
// The flow of a step lives in the files engine_impl.hpp lists.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <set>

#include "base/check.hpp"
#include "src/comm/timeout.hpp"
#include "src/engine_impl.hpp"
#include "zeroshard/config.hpp"

namespace zeroshard {

namespace {

// Checked before anything is allocated: a bad configuration, or one this build cannot run.
Config checked(Config c, const std::shared_ptr<Communicator>& comm) {
  c.validate();
  if (!comm) ZS_THROW(invalid_argument, "Engine: the communicator is null");
#ifndef ZEROSHARD_HAVE_URING
  if (c.offload_optimizer.tier == Tier::nvme || c.offload_param.tier == Tier::nvme)
    ZS_THROW(invalid_config,
             "Engine: the nvme tier needs io_uring, and this zeroshard was built without it "
             "(ZEROSHARD_WITH_URING=OFF); use offload device \"cpu\" or \"none\"");
#endif
  return c;
}

}  // namespace

Engine::Impl::Impl(Config c, std::shared_ptr<Communicator> cm, std::unique_ptr<Compute> dev)
    : cfg(checked(std::move(c), cm)),
      comm(std::move(cm)),
      res(cfg, std::move(dev)),
      scaler(cfg.loss_scale, cfg.dtype == DType::f16 && cfg.loss_scale.static_scale <= 0) {
  rank = comm->rank();
  world = comm->size();
  comm->set_timeout(cfg.collective_timeout_s);  // before the split: the groups inherit it
  if (cfg.train_batch_size > 0 && cfg.train_micro_batch_size_per_gpu > 0) {
    const int64_t per_step = cfg.train_micro_batch_size_per_gpu *
                             int64_t(cfg.gradient_accumulation_steps) * int64_t(world);
    if (per_step != cfg.train_batch_size) {
      const int64_t across = cfg.train_micro_batch_size_per_gpu * int64_t(world);
      std::string hint;
      if (cfg.train_batch_size % across == 0)
        hint = "; gradient_accumulation_steps = " + std::to_string(cfg.train_batch_size / across) +
               " would make them agree";
      ZS_THROW(invalid_config, "rank " << rank << ": train_batch_size = " << cfg.train_batch_size
                                       << " is not train_micro_batch_size_per_gpu ("
                                       << cfg.train_micro_batch_size_per_gpu
                                       << ") x gradient_accumulation_steps ("
                                       << cfg.gradient_accumulation_steps << ") x world size ("
                                       << world << ") = " << per_step << hint);
    }
  } else if (cfg.train_batch_size > 0) {
    // The micro-batch DeepSpeed would derive must be whole.
    const int64_t per_micro = int64_t(cfg.gradient_accumulation_steps) * int64_t(world);
    if (cfg.train_batch_size % per_micro != 0)
      ZS_THROW(invalid_config, "rank " << rank << ": train_batch_size = " << cfg.train_batch_size
                                       << " is not a multiple of gradient_accumulation_steps ("
                                       << cfg.gradient_accumulation_steps << ") x world size ("
                                       << world << ") = " << per_micro
                                       << ": no whole micro-batch per rank gives it");
  }
  topo.shard_world = cfg.shard_group_size == 0 ? world : cfg.shard_group_size;
  if (world % topo.shard_world != 0)
    ZS_THROW(invalid_config, "rank " << rank
                                     << ": zeroshard.shard_group_size = " << topo.shard_world
                                     << " does not divide the world size " << world);
  topo.shard_rank = rank % topo.shard_world;
  topo.replica = rank / topo.shard_world;
  topo.replicas = world / topo.shard_world;
  if (topo.replicas > 1 && cfg.stage == 0)
    ZS_THROW(invalid_config, "rank " << rank << ": zeroshard.shard_group_size = "
                                     << topo.shard_world << " of " << world
                                     << " ranks needs zero_optimization.stage >= 1 (stage 0 "
                                        "shards nothing)");
  if (topo.replicas > 1) {
    // Ranks that disagree would split into groups that do not match: they find out first (the
    // fingerprint of finalize() comes too late for that). A rank with flat sharding joins no
    // collective here, and the others' check times out.
    double sizes[2] = {double(topo.shard_world), -double(topo.shard_world)};
    comm->all_reduce(sizes, 2, ReduceOp::min, "the shard group size check")->wait();
    if (sizes[0] != -sizes[1])
      ZS_THROW(invalid_config, "rank " << rank << ": zeroshard.shard_group_size differs between "
                                       << "ranks (groups of " << sizes[0] << " to " << -sizes[1]
                                       << " ranks); every rank needs the same");
    std::vector<int> group, across;
    for (int r = 0; r < topo.shard_world; ++r) group.push_back(topo.replica * topo.shard_world + r);
    for (int g = 0; g < topo.replicas; ++g)
      across.push_back(g * topo.shard_world + topo.shard_rank);
    topo.shard_comm = res.dev->adapt(comm->split(group, "the shard groups"));
    topo.replica_comm = res.dev->adapt(comm->split(across, "the replicas across groups"));
  }
  comm = res.dev->adapt(std::move(comm));
  if (!topo.shard_comm) topo.shard_comm = comm;
  groups.push_back(cfg.optimizer);
  pdt = cfg.dtype;
  pbytes = dtype_size(pdt);
}

// The ring stops before the tiers' staging memory goes (members die after this body).
Engine::Impl::~Impl() {
  if (res.swap) res.swap->stop();
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

std::string Engine::Impl::where(int id) const {
  return "rank " + std::to_string(rank) + ", unit '" + layout(id).name + "'";
}

int Engine::Impl::num_states() const {
  const bool momentum = std::any_of(groups.begin(), groups.end(),
                                    [](const OptimizerOptions& g) { return g.momentum != 0; });
  int n = 0;  // the most any group's optimizer keeps (a Muon engine's AdamW groups keep two)
  for (const OptimizerOptions& g : groups) n = std::max(n, cpu::num_states(g.kind, momentum));
  return n;
}

std::vector<TensorView> Engine::Impl::views(int id, void* base) const {
  std::vector<TensorView> v;
  for (const ParamSlot& p : layout(id).params)
    v.push_back({static_cast<char*>(base) + size_t(p.offset) * pbytes, p.numel, pdt,
                 res.dev->device(), res.dev->device_index()});
  return v;
}

// ---- registration ------------------------------------------------------------------------------

Engine::Engine(Config config, std::shared_ptr<Communicator> comm)
    : impl_(std::make_unique<Impl>(std::move(config), std::move(comm))) {}

Engine::Engine(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

Engine::~Engine() {
  if (!impl_) return;
  // In-flight collectives write into buffers this engine owns: let them land first. One that
  // timed out may still complete when a late peer arrives; wait for that a while, too, but once:
  // one deadline for all of them, so a dead peer costs one timeout, not one per collective.
  using Clock = std::chrono::steady_clock;
  const auto deadline = Clock::now() + timeout_duration(impl_->cfg.collective_timeout_s);
  for (Unit& u : impl_->units)
    for (auto* w : {&u.reduction, &u.gather_work})
      if (*w)
        (*w)->wait_settled(
            std::max(0.0, std::chrono::duration<double>(deadline - Clock::now()).count()));
  // The device's queued work (updates, uploads) needs no wait here: it touches only memory the
  // engine took from the device's allocators, which wait for every stream when they free it
  // (cudaFree, cudaFreeHost; the asynchronous CPU device's heaps likewise), or host memory
  // registered with the device, whose registration ends by waiting for it (register_host()),
  // and the device outlives every buffer (Resources). A failure of that work stays with its
  // stream, as CUDA's do. scripts/mutate_waits.py found this wait unneeded; the asynchronous CPU
  // device aborts where it is destroyed with work in flight, so a teardown that frees memory
  // without waiting fails the suite.
}

int Engine::add_group(const OptimizerOptions& o) {
  Impl& m = *impl_;
  if (m.finalized)
    ZS_THROW(invalid_argument, "rank " << m.rank << ": add_group() after finalize()");
  if (!group_kind_allowed(m.cfg.optimizer.kind, o.kind))
    ZS_THROW(invalid_argument, "rank " << m.rank << ": add_group(): optimizer "
                                       << optimizer_name(o.kind) << " differs from the engine's "
                                       << optimizer_name(m.cfg.optimizer.kind)
                                       << " (only a muon engine takes other groups: adam, adamw)");
  Config probe = m.cfg;
  probe.optimizer = o;
  probe.validate();  // same range checks as group 0
  m.groups.push_back(o);
  return int(m.groups.size()) - 1;
}

int Engine::num_groups() const {
  return int(impl_->groups.size());
}

UnitId Engine::add_unit(std::string name, std::vector<Param> params) {
  Impl& m = *impl_;
  std::string at = "rank " + std::to_string(m.rank) + ": add_unit('" + name + "')";
  if (m.finalized) ZS_THROW(invalid_argument, at << " after finalize()");
  for (const UnitShape& s : m.shapes)
    if (s.layout.name == name) ZS_THROW(invalid_argument, at << ": a unit of that name exists");
  if (name.empty()) ZS_THROW(invalid_argument, at << ": the unit's name is empty");
  std::set<std::string> names;
  // A unit's elements, padding included, stay far below what int64 and byte counts can hold.
  constexpr int64_t kMaxUnitNumel = int64_t(1) << 48;
  int64_t total = 0;
  for (const Param& p : params) {
    if (p.name.empty()) ZS_THROW(invalid_argument, at << ": a parameter's name is empty");
    if (!names.insert(p.name).second)
      ZS_THROW(invalid_argument, at << ": parameter '" << p.name << "' twice");
    int64_t numel = 1;
    for (int64_t d : p.shape) {
      if (d < 0)
        ZS_THROW(invalid_argument,
                 at << ": parameter '" << p.name << "' has shape " << shape_string(p.shape));
      if (d > 0 && numel > kMaxUnitNumel / d)
        ZS_THROW(invalid_argument, at << ": parameter '" << p.name << "' of shape "
                                      << shape_string(p.shape)
                                      << " has more than 2^48 elements, more than a unit holds");
      numel *= d;
    }
    total += numel;
    if (total > kMaxUnitNumel)
      ZS_THROW(invalid_argument,
               at << ": the unit has more than 2^48 elements (at parameter '" << p.name << "')");
    if (p.group < 0 || size_t(p.group) >= m.groups.size())
      ZS_THROW(invalid_argument, at << ": parameter '" << p.name << "' names group " << p.group
                                    << " but " << m.groups.size() << " exist");
    if (p.init.data && (p.init.numel != shape_numel(p.shape) || p.init.device != Device::cpu))
      ZS_THROW(invalid_argument, at << ": initial values of '" << p.name << "' have "
                                    << p.init.numel << " elements (need " << shape_numel(p.shape)
                                    << ", on the CPU)");
    if (!p.init.data && p.init.numel != 0)
      ZS_THROW(invalid_argument, at << ": initial values of '" << p.name << "' have "
                                    << p.init.numel
                                    << " elements but no data (a null pointer; leave init empty "
                                       "for zeros)");
  }
  UnitShape s;
  s.layout = plan_unit(name, params, m.topo.shard_world, padding_grain(m.cfg));
  s.whole_runs = s.layout.runs(0, s.layout.padded_numel);
  const int64_t n = s.layout.shard_numel;
  s.shard_runs = s.layout.runs(m.topo.shard_rank * n, (m.topo.shard_rank + 1) * n);
  m.shapes.push_back(std::move(s));
  Unit& u = m.units.emplace_back();
  u.grad_seen.assign(params.size(), 0);
  u.held.assign(params.size(), 0);
  u.init_params = std::move(params);
  return UnitId(m.units.size() - 1);
}

// ---- accessors ---------------------------------------------------------------------------------

void Engine::set_lr(int group, float lr) {
  if (group < 0 || size_t(group) >= impl_->groups.size())
    ZS_THROW(invalid_argument, "set_lr(): no parameter group " << group);
  if (!(lr >= 0) || !std::isfinite(lr))
    ZS_THROW(invalid_argument, "set_lr(): lr = " << lr << " must be finite and >= 0");
  impl_->groups[size_t(group)].lr = lr;
}
float Engine::lr(int group) const {
  if (group < 0 || size_t(group) >= impl_->groups.size())
    ZS_THROW(invalid_argument, "lr(): no parameter group " << group);
  return impl_->groups[size_t(group)].lr;
}
// What set_options() refuses: another optimizer, a value construction would refuse, an SGD
// momentum that would turn its buffer on or off after finalize().
void Engine::Impl::check_options(int group, const OptimizerOptions& o, const char* call) const {
  if (group < 0 || size_t(group) >= groups.size())
    ZS_THROW(invalid_argument, call << ": no parameter group " << group);
  // After finalize() a group keeps its optimizer; before, a muon engine's may be adam or adamw.
  const OptimizerKind want = finalized ? groups[size_t(group)].kind : cfg.optimizer.kind;
  if (finalized ? o.kind != want : !group_kind_allowed(want, o.kind))
    ZS_THROW(invalid_argument, call << ": optimizer " << optimizer_name(o.kind)
                                    << " differs from the engine's " << optimizer_name(want)
                                    << (finalized ? " for group " + std::to_string(group) : ""));
  Config probe = cfg;
  probe.optimizer = o;
  probe.validate();  // the same range checks as at construction
  const OptimizerOptions& now = groups[size_t(group)];
  if (finalized && o.kind == OptimizerKind::sgd && (o.momentum != 0) != (now.momentum != 0))
    ZS_THROW(invalid_argument, call << ": group " << group << ": SGD momentum " << now.momentum
                                    << " -> " << o.momentum
                                    << " turns the momentum buffer on or off, which finalize() "
                                       "fixed; keep momentum zero or non-zero");
}

void Engine::set_options(int group, const OptimizerOptions& o) {
  impl_->check_options(group, o, "set_options()");
  impl_->groups[size_t(group)] = o;
}
const OptimizerOptions& Engine::options(int group) const {
  if (group < 0 || size_t(group) >= impl_->groups.size())
    ZS_THROW(invalid_argument, "options(): no parameter group " << group);
  return impl_->groups[size_t(group)];
}
float Engine::loss_scale() const {
  return impl_->scaler.scale();
}
LossScalerState Engine::loss_scaler_state() const {
  return impl_->scaler.state();
}
void Engine::set_loss_scaler_state(const LossScalerState& st) {
  if (!(st.scale > 0) || st.hysteresis_left < 0 || st.iteration < 0 || st.last_overflow < -1)
    ZS_THROW(invalid_argument, "set_loss_scaler_state(): scale "
                                   << st.scale << ", hysteresis_left " << st.hysteresis_left
                                   << ", iteration " << st.iteration << ", last_overflow "
                                   << st.last_overflow << " is not a scaler's state");
  impl_->scaler.set_state(st);
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
  return impl_->layout(id).name;
}
const Config& Engine::config() const {
  return impl_->cfg;
}
const std::shared_ptr<Communicator>& Engine::communicator() const {
  return impl_->comm;
}
void* Engine::stream() const {
  return impl_->res.dev->stream();
}
void Engine::set_stream(void* stream) {
  impl_->res.dev->set_stream(stream);
}

std::vector<Param> Engine::unit_params(UnitId id) const {
  if (id < 0 || size_t(id) >= impl_->units.size())
    ZS_THROW(invalid_argument, "unit_params(): no unit " << id);
  std::vector<Param> out;
  for (const ParamSlot& p : impl_->layout(id).params)
    out.push_back(Param{p.name, p.shape, p.group});
  return out;
}

bool Engine::has_state(StateKind kind) const {
  int n = impl_->num_states();
  return kind == StateKind::state1 ? n >= 2 : kind == StateKind::state0 ? n >= 1 : true;
}
MemoryReport Engine::memory() const {
  return impl_->res.ledger.report();
}

ShardInfo Engine::shard_info(UnitId id) const {
  const Impl& m = *impl_;
  if (id < 0 || size_t(id) >= m.units.size())
    ZS_THROW(invalid_argument, "shard_info(): no unit " << id);
  const UnitLayout& L = m.layout(id);
  return {L.numel, L.padded_numel, m.topo.shard_rank * L.shard_numel, L.shard_numel};
}

ShardGroup Engine::shard_group() const {
  const Impl& m = *impl_;
  return {m.topo.shard_rank, m.topo.shard_world, m.topo.replica, m.topo.replicas};
}
SwapStats Engine::swap_stats() const {
  SwapStats s;
  const Impl& m = *impl_;
  if (!m.res.swap || !m.res.swap->started()) return s;
  const offload::IoCounters c = m.res.swap->io().counters();
  s.bytes_read = c.bytes_read;
  s.bytes_written = c.bytes_written;
  s.requests = c.requests;
  s.resubmitted = c.resubmitted;
  s.wait_s = m.res.swap->io().wait_seconds();
  return s;
}

std::vector<std::string> Engine::swap_files() const {
  return impl_->res.swap ? impl_->res.swap->files() : std::vector<std::string>{};
}

}  // namespace zeroshard
