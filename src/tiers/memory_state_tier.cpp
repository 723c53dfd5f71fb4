// The optimizer state in memory (see memory_state_tier.hpp). Stage 0 keeps the whole state and
// reads the whole all-reduced gradient; the other stages keep this rank's shard.
#include "src/tiers/memory_state_tier.hpp"

#include <cmath>
#include <cstring>
#include <limits>
#include <tuple>

#include "kernels/cpu/grad_passes.hpp"
#include "kernels/cpu/update_tasks.hpp"
#include "src/base/check.hpp"
#include "zeroshard/communicator.hpp"

namespace zeroshard {

MemoryStateTier::MemoryStateTier(const TierContext& ctx, Tier tier, Compute& compute,
                                 cpu::Arena& arena,
                                 const std::vector<std::optional<float*>>& master_alias,
                                 bool previews)
    : ctx_(ctx),
      compute_(compute),
      arena_(arena),
      on_cpu_(compute.device() == Device::cpu),
      units_(ctx.units->size()) {
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
      s.master = *master_alias[i];
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

// Folds the micro-step into the f32 accumulator: acc = g on the first one (no zeroing pass). On
// the CPU, the final micro-step also takes the unit's share of the norm, during backward and in
// the pass that folds it when there is one, so that step() is the all-reduce and the update. A
// GPU sums at step time instead, one launch per unit on its stream: a result waited for here
// would stall the stream in the middle of backward.
void MemoryStateTier::grad_reduced(int u, int micro, const void* whole) {
  Unit& s = units_[size_t(u)];
  s.whole_grad = whole;
  const int k = ctx_.accumulation();
  const bool final = micro + 1 == k;
  // This rank's share of the norm: its shard (stage 0 sums the same elements of its whole copy).
  const int64_t own = ctx_.cfg->stage == 0 ? ctx_.rank * ctx_.shard(u) : 0;
  const int64_t S = ctx_.shard(u), ext = ctx_.extent(u);
  const void* g = ctx_.cfg->stage == 0 ? whole : s.grad_shard.data();
  if (!on_cpu_) {
    if (k == 1) return;
    if (micro == 0)
      compute_.convert(g, ctx_.pdt, s.accum.data(), DType::f32, ext);
    else
      compute_.accumulate(s.accum.as<float>(), g, ctx_.pdt, ext);
    return;
  }
  const char* gc = static_cast<const char*>(g);
  if (k == 1) {
    s.sumsq = cpu::parallel_sum_squares(arena_, gc + size_t(own) * ctx_.pbytes, ctx_.pdt, S);
    return;
  }
  // Around the rank's own elements (stage 0's whole extent), the fold alone.
  float* acc = s.accum.as<float>();
  auto fold = [&](int64_t b, int64_t e, bool sum) {
    return cpu::fold_grad(arena_, acc + b, gc + size_t(b) * ctx_.pbytes, ctx_.pdt, e - b,
                          micro == 0, sum);
  };
  fold(0, own, false);
  const double part = fold(own, own + S, final);
  fold(own + S, ext, false);
  if (final) s.sumsq = part;
}

std::pair<const void*, DType> MemoryStateTier::grad(int u) const {
  const Unit& s = units_[size_t(u)];
  if (ctx_.accumulation() > 1) return {s.accum.data(), DType::f32};
  return {ctx_.cfg->stage == 0 ? s.whole_grad : s.grad_shard.data(), ctx_.pdt};
}

// Summed in unit order either way: the CPU's shares taken in grad_reduced(), the GPU's here.
double MemoryStateTier::sum_squares() {
  double sum = 0.0;
  bool nonfinite = false;
  if (on_cpu_) {
    for (const Unit& s : units_) sum += s.sumsq;
  } else {
    std::vector<GradSpan> spans;
    for (size_t i = 0; i < units_.size(); ++i) {
      const int u = int(i);
      auto [g, dt] = grad(u);
      const int64_t base = ctx_.cfg->stage == 0 ? ctx_.rank * ctx_.shard(u) : 0;
      spans.push_back(
          {static_cast<const char*>(g) + size_t(base) * dtype_size(dt), dt, ctx_.shard(u)});
    }
    std::tie(sum, nonfinite) = compute_.sum_squares(spans);
  }
  // A square of an inf or NaN makes the CPU's sum inf or NaN: no separate flag pass.
  return nonfinite || !std::isfinite(sum) ? std::numeric_limits<double>::infinity() : sum;
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
