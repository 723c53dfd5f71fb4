// The optimizer state in memory (see memory_state_tier.hpp). Stage 0 keeps the whole state and
// reads the whole all-reduced gradient; the other stages keep this rank's shard.
#include "src/tiers/memory_state_tier.hpp"

#include <cstring>
#include <limits>

#include "kernels/cpu/update_tasks.hpp"
#include "src/base/check.hpp"
#include "zeroshard/communicator.hpp"

namespace zeroshard {

MemoryStateTier::MemoryStateTier(const TierContext& ctx, Tier tier, Compute& compute,
                                 cpu::Arena& arena, const std::vector<float*>& master_alias,
                                 bool previews)
    : ctx_(ctx), compute_(compute), arena_(arena), units_(ctx.units->size()) {
  const Config& cfg = *ctx.cfg;
  const bool pin = cfg.offload_optimizer.pin_memory;
  for (size_t i = 0; i < units_.size(); ++i) {
    Unit& s = units_[i];
    const int u = int(i);
    const size_t ext = size_t(ctx.extent(u));
    // Stages 0–1 keep the trainer's whole gradient too: the shard is a staging buffer there.
    const bool sharded = cfg.stage >= 2;
    s.grad_shard =
        ctx.buffer(tier, sharded ? MemKind::grad : MemKind::buffer, sharded ? "grad" : "grad_shard",
                   size_t(ctx.shard(u)) * ctx.pbytes, pin);
    if (ctx.accumulation() > 1)
      s.accum = ctx.buffer(tier, MemKind::buffer, "grad_accum", ext * 4, pin);
    if (master_alias[i]) {
      s.master = master_alias[i];
    } else {
      s.master_buf = ctx.buffer(tier, MemKind::master, "master", ext * 4, pin);
      s.master = s.master_buf.as<float>();
    }
    if (ctx.num_states >= 1) {
      s.state0_buf = ctx.buffer(tier, MemKind::optim_state, "state0", ext * 4, pin);
      s.state0 = s.state0_buf.as<float>();
    }
    if (ctx.num_states >= 2) {
      s.state1_buf = ctx.buffer(tier, MemKind::optim_state, "state1", ext * 4, pin);
      s.state1 = s.state1_buf.as<float>();
    }
  }
  if (previews)
    scratch_ = ctx.buffer(Tier::host, MemKind::buffer, "update_scratch",
                          size_t(arena.threads()) * 3 * size_t(cpu::Arena::kChunk) * 4, false);
}

// Initial values go through f32 once: the master is the extent of `whole`; the low-precision
// copy is rounded from it by the parameter tier, so every stage starts from the same bits.
void MemoryStateTier::load_initial(int u, const float* whole) {
  Unit& s = units_[size_t(u)];
  if (!whole || s.master_buf.empty()) return;  // zeros, or the parameters are the master
  const int64_t b = ctx_.cfg->stage == 0 ? 0 : ctx_.rank * ctx_.shard(u);
  compute_.copy(s.master, whole + b, size_t(ctx_.extent(u)) * 4);
  compute_.synchronize();  // before `whole` is refilled
}

// Folds the micro-step into the f32 accumulator: acc = g on the first one (no zeroing pass).
void MemoryStateTier::grad_reduced(int u, int micro, const void* whole) {
  Unit& s = units_[size_t(u)];
  s.whole_grad = whole;
  if (ctx_.accumulation() == 1) return;
  const void* g = ctx_.cfg->stage == 0 ? whole : s.grad_shard.data();
  if (micro == 0)
    compute_.convert(g, ctx_.pdt, s.accum.data(), DType::f32, ctx_.extent(u));
  else
    compute_.accumulate(s.accum.as<float>(), g, ctx_.pdt, ctx_.extent(u));
}

std::pair<const void*, DType> MemoryStateTier::grad(int u) const {
  const Unit& s = units_[size_t(u)];
  if (ctx_.accumulation() > 1) return {s.accum.data(), DType::f32};
  return {ctx_.cfg->stage == 0 ? s.whole_grad : s.grad_shard.data(), ctx_.pdt};
}

// The gradient each rank owns: its shard (stage 0 reads the same elements of its whole copy).
double MemoryStateTier::sum_squares() {
  std::vector<GradSpan> spans;
  for (size_t i = 0; i < units_.size(); ++i) {
    const int u = int(i);
    auto [g, dt] = grad(u);
    const int64_t base = ctx_.cfg->stage == 0 ? ctx_.rank * ctx_.shard(u) : 0;
    spans.push_back(
        {static_cast<const char*>(g) + size_t(base) * dtype_size(dt), dt, ctx_.shard(u)});
  }
  auto [sum, nonfinite] = compute_.sum_squares(spans);
  return nonfinite ? std::numeric_limits<double>::infinity() : sum;
}

cpu::UnitUpdate MemoryStateTier::unit_update(int u, float* master, float* s0, float* s1,
                                             void* out) const {
  auto [g, dt] = grad(u);
  cpu::UnitUpdate w;
  w.runs = &ctx_.runs(u);
  w.args.master = master;
  w.args.state0 = s0;
  w.args.state1 = s1;
  w.args.grad = g;
  w.args.grad_dtype = dt;
  if (out) {
    w.args.out = out;
    w.args.out_dtype = ctx_.pdt;
  }
  w.args.n = ctx_.extent(u);
  return w;
}

void MemoryStateTier::update(const std::vector<cpu::UpdateHyper>& hyper, int64_t, ParamSink& sink) {
  std::vector<cpu::UnitUpdate> updates;
  for (size_t i = 0; i < units_.size(); ++i) {
    const Unit& s = units_[i];
    updates.push_back(unit_update(int(i), s.master, s.state0, s.state1, sink.target(int(i))));
  }
  if (sink.per_unit()) {
    // Unit by unit, so what done() starts (an upload) overlaps the next unit's update.
    for (size_t i = 0; i < units_.size(); ++i) {
      compute_.update(hyper, {updates[i]});
      sink.done(int(i));
    }
    return;
  }
  compute_.update(hyper, updates);
  for (size_t i = 0; i < units_.size(); ++i) sink.done(int(i));
}

// The same tasks as update(), each on copies of its chunk of master and moments: the state is
// untouched, and the copy-out is bitwise what update() writes.
void MemoryStateTier::preview(const std::vector<cpu::UpdateHyper>& hyper, int u, void* out) {
  ZS_CHECK(!scratch_.empty());
  const Unit& s = units_[size_t(u)];
  std::vector<cpu::UpdateTask> tasks;
  cpu::append_update_tasks(hyper, unit_update(u, s.master, s.state0, s.state1, out), tasks);
  float* scratch = scratch_.as<float>();
  arena_.parallel_for(int64_t(tasks.size()), [&](int64_t t) {
    float* sc = scratch + size_t(arena_.slot()) * 3 * size_t(cpu::Arena::kChunk);
    cpu::UpdateArgs a = tasks[size_t(t)].a;
    const size_t bytes = size_t(a.n) * 4;
    a.master = static_cast<float*>(std::memcpy(sc, a.master, bytes));
    if (a.state0)
      a.state0 = static_cast<float*>(std::memcpy(sc + cpu::Arena::kChunk, a.state0, bytes));
    if (a.state1)
      a.state1 = static_cast<float*>(std::memcpy(sc + 2 * cpu::Arena::kChunk, a.state1, bytes));
    cpu::optimizer_update(arena_.isa(), *tasks[size_t(t)].h, a);
  });
}

float* MemoryStateTier::state(int u, StateKind kind) const {
  const Unit& s = units_[size_t(u)];
  float* base = kind == StateKind::master   ? s.master
                : kind == StateKind::state0 ? s.state0
                : kind == StateKind::state1 ? s.state1
                                            : nullptr;
  // This rank's shard: the f32 state is whole only in stage 0.
  const int64_t off = ctx_.cfg->stage == 0 ? ctx_.rank * ctx_.shard(u) : 0;
  return base ? base + off : nullptr;
}

std::vector<float> MemoryStateTier::read(int u, StateKind kind) const {
  const float* src = state(u, kind);
  if (!src)
    ZS_THROW(invalid_argument, "read_shard(): " << ctx_.where(u) << ": optimizer "
                                                << optimizer_name(ctx_.cfg->optimizer.kind)
                                                << " keeps no such state");
  std::vector<float> out(size_t(ctx_.shard(u)));
  compute_.copy(out.data(), src, out.size() * 4);
  compute_.synchronize();
  return out;
}

const float* MemoryStateTier::host_view(int u, StateKind kind) const {
  return compute_.device() == Device::cpu ? state(u, kind) : nullptr;
}

float* MemoryStateTier::host_target(int u, StateKind kind) {
  return compute_.device() == Device::cpu ? state(u, kind) : nullptr;
}

void MemoryStateTier::write(int u, StateKind kind, const std::vector<float>& shard) {
  float* dst = state(u, kind);
  if (!dst)
    ZS_THROW(invalid_argument, "write_shard(): " << ctx_.where(u) << ": no such writable state");
  compute_.copy(dst, shard.data(), shard.size() * 4);
  compute_.synchronize();
}

void MemoryStateTier::commit(Communicator& comm, ParamSink& sink) {
  std::vector<std::shared_ptr<Work>> works;
  if (ctx_.cfg->stage == 0) {  // whole f32 state on every rank: gather the restored shards
    compute_.before_collective();
    for (size_t i = 0; i < units_.size(); ++i) {
      const int64_t n = ctx_.shard(int(i)), off = ctx_.rank * n;
      const std::string what = "unit '" + ctx_.unit(int(i)).layout.name + "' (restored state)";
      for (float* f : {units_[i].master, units_[i].state0, units_[i].state1})
        if (f) works.push_back(comm.all_gather(f + off, f, n, DType::f32, what));
    }
  }
  for (auto& w : works) w->wait();
  // The parameters are rounded from the master where the master lives.
  for (size_t i = 0; i < units_.size(); ++i) {
    const int u = int(i);
    if (void* out = sink.target(u)) {
      compute_.convert(units_[i].master, DType::f32, out, ctx_.pdt, ctx_.extent(u));
      sink.done(u);
    } else if (!units_[i].master_buf.empty()) {
      sink.restore(u, read(u, StateKind::master).data());  // parameters off this memory
    }
  }
}

}  // namespace zeroshard
