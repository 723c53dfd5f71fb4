// The optimizer state in memory (see memory_state_tier.hpp). Stage 0 keeps the whole state and
// reads the whole all-reduced gradient; the other stages keep this rank's shard.
#include "src/tiers/memory_state_tier.hpp"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <tuple>
#include <utility>

#include "base/check.hpp"
#include "kernels/cpu/grad_passes.hpp"
#include "kernels/cpu/quant_code.hpp"
#include "kernels/cpu/update_tasks.hpp"
#include "zeroshard/communicator.hpp"

namespace zeroshard {

MemoryStateTier::MemoryStateTier(const TierContext& ctx, Tier tier, Compute& compute,
                                 cpu::Arena& arena,
                                 const std::vector<std::optional<float*>>& master_alias,
                                 bool previews, Speculative speculative)
    : ctx_(ctx),
      compute_(compute),
      arena_(arena),
      on_cpu_(!compute.streams()),
      format_(ctx.cfg->optimizer_state),
      master_dtype_(ctx.master_dtype()),
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
      s.master_buf =
          ctx.buffer(tier, MemKind::master, "master", ext * dtype_size(master_dtype_), pin);
      s.master = s.master_buf.data();
    }
    // Moments in their format; q8 adds one f32 absmax per block, and starts every element at
    // the code of 0.
    const size_t sbytes = cpu::state_bytes(format_);
    const size_t blocks = format_ == StateFormat::q8 ? size_t(ext) / size_t(cfg.state_block) : 0;
    auto moment = [&](const char* name, const char* absmax_name, Buffer& buf, void*& data,
                      Buffer& absmax_buf, float*& absmax) {
      buf = ctx.buffer(tier, MemKind::optim_state, name, ext * sbytes, pin);
      data = buf.data();
      if (format_ != StateFormat::q8) return;
      absmax_buf = ctx.buffer(tier, MemKind::optim_state, absmax_name, blocks * 4, pin);
      absmax = absmax_buf.as<float>();
      if (!ctx.plan_only) compute_.fill(data, cpu::kQ8Zero, ext);
    };
    if (ctx.num_states >= 1)
      moment("state0", "state0_absmax", s.state0_buf, s.state0, s.absmax0_buf, s.absmax0);
    if (ctx.num_states >= 2)
      moment("state1", "state1_absmax", s.state1_buf, s.state1, s.absmax1_buf, s.absmax1);
  }
  if (previews)
    scratch_ = ctx.buffer(Tier::host, MemKind::buffer, "update_scratch",
                          size_t(arena.threads()) * preview_layout()[5], false);
  if (speculative == Speculative::off || !on_cpu_) return;
  // The speculative step's second copy of every unit's state (none for a unit whose master is
  // its parameters: their memory is the parameter tier's), counted as what it copies.
  spec_ = std::vector<Speculation>(units_.size());  // built in place: they hold an atomic
  for (size_t i = 0; i < units_.size(); ++i) {
    if (master_alias[i]) continue;
    Speculation& sp = spec_[i];
    const Unit& s = units_[i];
    const size_t ext = size_t(ctx.extent(int(i)));
    auto twin = [&](const Buffer& b, MemKind kind, const char* name) {
      return b.bytes() ? ctx.buffer(tier, kind, name, b.bytes(), pin) : Buffer();
    };
    sp.master = twin(s.master_buf, MemKind::master, "master_speculative");
    sp.state0 = twin(s.state0_buf, MemKind::optim_state, "state0_speculative");
    sp.state1 = twin(s.state1_buf, MemKind::optim_state, "state1_speculative");
    sp.absmax0 = twin(s.absmax0_buf, MemKind::optim_state, "state0_absmax_speculative");
    sp.absmax1 = twin(s.absmax1_buf, MemKind::optim_state, "state1_absmax_speculative");
    if (format_ == StateFormat::q8 && !ctx.plan_only) {  // as the first copy starts
      if (!sp.state0.empty()) compute_.fill(sp.state0.data(), cpu::kQ8Zero, ext);
      if (!sp.state1.empty()) compute_.fill(sp.state1.data(), cpu::kQ8Zero, ext);
    }
    if (speculative == Speculative::own_out)
      sp.own_out = ctx.buffer(tier, MemKind::buffer, "param_speculative", ext * ctx.pbytes, false);
  }
}

// Initial values go through f32 once: the master is the extent of `whole` (a bf16 master
// rounded to nearest, as the parameter tier rounds its copy); the low-precision copy is rounded
// from it by the parameter tier, so every stage starts from the same bits.
void MemoryStateTier::load_initial(int u, const float* whole) {
  Unit& s = units_[size_t(u)];
  if (!whole || s.master_buf.empty()) return;  // zeros, or the parameters are the master
  compute_.convert(whole + ctx_.extent_start(u), DType::f32, s.master, master_dtype_,
                   ctx_.extent(u));
  compute_.synchronize();  // before `whole` is refilled
}

// Folds the micro-step into the f32 accumulator: acc = g on the first one (no zeroing pass). On
// the CPU, the final micro-step also takes the unit's share of the norm, during backward and in
// the pass that folds it when there is one, so that step() is the all-reduce and the update. A
// GPU sums at step time instead, one launch per unit on its stream: a result waited for here
// would stall the stream in the middle of backward. With the speculative step the final
// micro-step's pass runs on the speculation thread, ahead of the unit's update, so that the
// trainer's thread (a GPU's, which must keep launching backward) does no CPU pass meanwhile.
void MemoryStateTier::grad_reduced(int u, int micro, const void* whole) {
  Unit& s = units_[size_t(u)];
  s.whole_grad = whole;
  const bool final = micro + 1 == ctx_.accumulation();
  if (final && on_cpu_ && !spec_.empty() && !s.master_buf.empty()) {
    thread_.post([this, u, micro] { take_grad(u, micro); }, true);  // before any update
    return;
  }
  take_grad(u, micro);
}

void MemoryStateTier::take_grad(int u, int micro) {
  Unit& s = units_[size_t(u)];
  const void* whole = s.whole_grad;
  const int k = ctx_.accumulation();
  const bool final = micro + 1 == k;
  // This rank's share of the norm: its shard (stage 0 sums the same elements of its whole copy).
  const int64_t own = ctx_.cfg->stage == 0 ? ctx_.shard_rank * ctx_.shard(u) : 0;
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

// A failure of a gradient's pass on the speculation thread, for the engine to agree on.
std::optional<Error> MemoryStateTier::settle_grads() {
  if (spec_.empty()) return std::nullopt;
  thread_.settle_first();
  try {
    if (std::exception_ptr failed = thread_.take_failure()) std::rethrow_exception(failed);
  } catch (const Error& e) {
    return e;
  } catch (const std::exception& e) {
    return Error(ErrorCode::internal,
                 "rank " + std::to_string(ctx_.rank) + ": the speculation thread: " + e.what());
  }
  return std::nullopt;
}

// Summed in unit order either way: the CPU's shares taken in grad_reduced(), the GPU's here.
double MemoryStateTier::sum_squares() {
  double sum = 0.0;
  bool nonfinite = false;
  if (on_cpu_) {
    if (!spec_.empty()) thread_.settle_first();  // the final micro-step's passes
    for (const Unit& s : units_) sum += s.sumsq;
  } else {
    std::vector<GradSpan> spans;
    for (size_t i = 0; i < units_.size(); ++i) {
      const int u = int(i);
      auto [g, dt] = grad(u);
      const int64_t base = ctx_.cfg->stage == 0 ? ctx_.shard_rank * ctx_.shard(u) : 0;
      spans.push_back(
          {static_cast<const char*>(g) + size_t(base) * dtype_size(dt), dt, ctx_.shard(u)});
    }
    std::tie(sum, nonfinite) = compute_.sum_squares(spans);
  }
  // A square of an inf or NaN makes the CPU's sum inf or NaN: no separate flag pass.
  return nonfinite || !std::isfinite(sum) ? std::numeric_limits<double>::infinity() : sum;
}

cpu::UnitUpdate MemoryStateTier::unit_update(int u, void* out, int64_t step) const {
  const Unit& s = units_[size_t(u)];
  auto [g, dt] = grad(u);
  cpu::UnitUpdate w;
  w.runs = &ctx_.runs(u);
  w.args.master = s.master;
  w.args.master_dtype = master_dtype_;
  w.args.round_key = cpu::rounding_key(step, u);
  w.args.index = ctx_.extent_start(u);
  w.args.state0 = s.state0;
  w.args.state1 = s.state1;
  w.args.state_format = format_;
  w.args.absmax0 = s.absmax0;
  w.args.absmax1 = s.absmax1;
  w.args.block = ctx_.cfg->state_block;
  w.args.grad = g;
  w.args.grad_dtype = dt;
  if (out) {
    w.args.out = out;
    w.args.out_dtype = ctx_.pdt;
  }
  w.args.n = ctx_.extent(u);
  return w;
}

void MemoryStateTier::update(const std::vector<cpu::UpdateHyper>& hyper, int64_t step,
                             ParamSink& sink) {
  // A speculation is kept where this update would read exactly what it read: bitwise its
  // result. The others are cancelled first, so that a step which keeps none (it clips) waits
  // only for the one the thread is running.
  std::vector<bool> keep(units_.size(), false);
  counted_ = {};
  counted_.dropped = std::exchange(dropped_early_, 0);
  if (!spec_.empty()) {
    for (size_t i = 0; i < spec_.size(); ++i) {
      if (!spec_[i].posted) continue;
      keep[i] = matches(int(i), hyper, step);
      spec_[i].cancel = !keep[i];
    }
    thread_.settle();
    for (size_t i = 0; i < spec_.size(); ++i) {
      Speculation& sp = spec_[i];
      if (!sp.posted) continue;
      keep[i] = keep[i] && sp.ready;
      ++(keep[i] ? counted_.kept : counted_.dropped);
      sp.posted = sp.ready = false;
    }
  }
  std::vector<cpu::UnitUpdate> updates(units_.size());
  for (size_t i = 0; i < units_.size(); ++i)
    if (!keep[i]) updates[i] = unit_update(int(i), sink.target(int(i)), step);
  if (sink.per_unit() || ctx_.direction) {
    // Unit by unit: what done() starts (an upload) overlaps the next unit's update, and Muon's
    // direction is made just before its unit's update, in memory the next one reuses.
    for (size_t i = 0; i < units_.size(); ++i) {
      if (keep[i]) {
        keep_speculation(int(i), sink);
      } else {
        if (ctx_.direction) updates[i].args.dir = ctx_.direction(int(i), updates[i].args);
        compute_.update(hyper, {updates[i]});
      }
      sink.done(int(i));
    }
    return;
  }
  std::erase_if(updates, [](const cpu::UnitUpdate& w) { return w.runs == nullptr; });
  compute_.update(hyper, updates);
  for (size_t i = 0; i < units_.size(); ++i) {
    if (keep[i]) keep_speculation(int(i), sink);
    sink.done(int(i));
  }
}

bool MemoryStateTier::matches(int u, const std::vector<cpu::UpdateHyper>& hyper,
                              int64_t step) const {
  const Speculation& sp = spec_[size_t(u)];
  return sp.step == step && same_update(sp.hyper, sp.runs, hyper, ctx_.runs(u));
}

void MemoryStateTier::speculate(int u, const std::vector<cpu::UpdateHyper>& hyper, int64_t step,
                                void* out) {
  if (spec_.empty() || units_[size_t(u)].master_buf.empty()) return;
  Speculation& sp = spec_[size_t(u)];
  sp.out = out ? out : sp.own_out.data();
  ZS_CHECK(sp.out);
  sp.posted = true;
  sp.ready = false;
  sp.cancel = false;
  sp.hyper = hyper;
  sp.step = step;
  sp.runs = ctx_.runs(u);  // the step's may differ (a parameter held): then it is dropped
  thread_.post([this, u] {
    try {
      run_speculation(u);
    } catch (...) {
      spec_[size_t(u)].ready = false;  // the step's update computes it
    }
  });
}

// The update's tasks on copies of their chunks of master, moments and absmax, into the second
// copy at the same offsets. The elements no task covers (the padding) are never written: the
// two copies hold the same there from the start (the constructor), so the second is the whole
// state once it is swapped in.
void MemoryStateTier::run_speculation(int u) {
  const Unit& s = units_[size_t(u)];
  Speculation& sp = spec_[size_t(u)];
  if (sp.cancel) return;  // not kept by the step: not worth computing
  cpu::UnitUpdate w = unit_update(u, sp.out, sp.step);
  w.runs = &sp.runs;
  std::vector<cpu::UpdateTask> tasks;
  cpu::append_update_tasks(sp.hyper, w, tasks);
  const void* live[] = {s.master, s.state0, s.state1, s.absmax0, s.absmax1};
  char* twin[] = {sp.master.as<char>(), sp.state0.as<char>(), sp.state1.as<char>(),
                  sp.absmax0.as<char>(), sp.absmax1.as<char>()};
  run_on_copies(tasks, [&](int k, const void* p) {
    return twin[k] + (static_cast<const char*>(p) - static_cast<const char*>(live[k]));
  });
  sp.ready = true;
}

void MemoryStateTier::keep_speculation(int u, ParamSink& sink) {
  Unit& s = units_[size_t(u)];
  Speculation& sp = spec_[size_t(u)];
  std::swap(s.master_buf, sp.master);
  std::swap(s.state0_buf, sp.state0);
  std::swap(s.state1_buf, sp.state1);
  std::swap(s.absmax0_buf, sp.absmax0);
  std::swap(s.absmax1_buf, sp.absmax1);
  s.master = s.master_buf.data();
  s.state0 = s.state0_buf.data();
  s.state1 = s.state1_buf.data();
  s.absmax0 = s.absmax0_buf.as<float>();
  s.absmax1 = s.absmax1_buf.as<float>();
  hand_to_sink(sink, u, sp.own_out, sp.out, size_t(ctx_.extent(u)) * ctx_.pbytes, arena_);
}

void MemoryStateTier::drop_speculation() {
  if (spec_.empty()) return;
  for (Speculation& sp : spec_) sp.cancel = true;
  thread_.settle();
  (void)thread_.take_failure();  // the gradients it concerns are dropped too
  for (Speculation& sp : spec_) {
    dropped_early_ += sp.posted;
    sp.posted = sp.ready = false;
  }
}

void MemoryStateTier::forget_grads() {
  drop_speculation();
  counted_ = {};  // the step ends here (skipped)
  counted_.dropped = std::exchange(dropped_early_, 0);
}

void MemoryStateTier::drop_speculation(int u) {
  if (spec_.empty()) return;
  spec_[size_t(u)].cancel = true;
  thread_.settle();
  dropped_early_ += spec_[size_t(u)].posted;  // counted with the step it was for
  spec_[size_t(u)].posted = spec_[size_t(u)].ready = false;
}

// The same tasks as update(), each on copies of its chunk of master and moments (and absmax)
// in this thread's scratch: the state is untouched, and the copy-out is bitwise what update()
// writes.
void MemoryStateTier::preview(const std::vector<cpu::UpdateHyper>& hyper, int64_t step, int u,
                              void* out) {
  ZS_CHECK(!scratch_.empty());
  std::vector<cpu::UpdateTask> tasks;
  cpu::UnitUpdate w = unit_update(u, out, step);
  if (ctx_.direction) w.args.dir = ctx_.direction(u, w.args);
  cpu::append_update_tasks(hyper, w, tasks);
  const std::array<size_t, 6> at = preview_layout();
  run_on_copies(tasks, [&](int k, const void*) {
    return scratch_.as<char>() + size_t(arena_.slot()) * at[5] + at[size_t(k)];
  });
}

// Each task on copies of its chunk of master, moments and absmax (arrays 0 to 4), made where
// place(k, start of the chunk in array k) says, in the task's thread.
void MemoryStateTier::run_on_copies(const std::vector<cpu::UpdateTask>& tasks,
                                    const std::function<char*(int, const void*)>& place) {
  const size_t mb = dtype_size(master_dtype_), sb = cpu::state_bytes(format_);
  arena_.parallel_for(int64_t(tasks.size()), [&](int64_t t) {
    cpu::UpdateTask task = tasks[size_t(t)];
    cpu::UpdateArgs& a = task.a;
    const size_t n = size_t(a.n);
    const size_t blocks =
        format_ == StateFormat::q8 ? (n + size_t(a.block) - 1) / size_t(a.block) : 0;
    int k = 0;
    auto take = [&](auto*& p, size_t bytes) {
      const int array = k++;
      if (!p) return;
      using P = std::remove_reference_t<decltype(p)>;
      p = static_cast<P>(std::memcpy(place(array, p), p, bytes));
    };
    take(a.master, n * mb);
    take(a.state0, n * sb);
    take(a.state1, n * sb);
    take(a.absmax0, blocks * 4);
    take(a.absmax1, blocks * 4);
    cpu::run_update_task(arena_.isa(), task);
  });
}

// One thread's copies in preview()'s scratch: master, two moments, two absmax arrays, each
// started on a cache line; [5] is the whole slot.
std::array<size_t, 6> MemoryStateTier::preview_layout() const {
  const size_t chunk = size_t(cpu::Arena::kChunk), sb = cpu::state_bytes(format_);
  const size_t blocks = chunk / size_t(ctx_.cfg->state_block) + 1;
  const size_t bytes[] = {chunk * 4, chunk * sb, chunk * sb, blocks * 4, blocks * 4};
  std::array<size_t, 6> at{};
  for (size_t k = 0; k < 5; ++k) at[k + 1] = at[k] + size_t(round_up(int64_t(bytes[k]), 64));
  return at;
}

// This rank's shard: the state is whole only in stage 0. A multiple of the q8 block, since
// shards are padded to whole blocks.
int64_t MemoryStateTier::shard_offset(int u) const {
  return ctx_.cfg->stage == 0 ? ctx_.shard_rank * ctx_.shard(u) : 0;
}

void MemoryStateTier::check_kind(const char* call, int u, StateKind kind) const {
  const Unit& s = units_[size_t(u)];
  const bool ok = kind == StateKind::master || (kind == StateKind::state0 && s.state0) ||
                  (kind == StateKind::state1 && s.state1);
  if (!ok)
    ZS_THROW(invalid_argument, call << ": " << ctx_.where(u) << ": optimizer "
                                    << optimizer_name(ctx_.cfg->optimizer.kind)
                                    << " keeps no such state");
}

char* MemoryStateTier::master_at(int u, StateKind kind) const {
  if (kind != StateKind::master) return nullptr;
  return static_cast<char*>(units_[size_t(u)].master) +
         size_t(shard_offset(u)) * dtype_size(master_dtype_);
}

// The moments widen to f32 here (bf16 exactly; q8 as code × absmax), so checkpoints and
// read_shard() see every format alike.
std::vector<float> MemoryStateTier::read(int u, StateKind kind) const {
  check_kind("read_shard()", u, kind);
  const Unit& s = units_[size_t(u)];
  const int64_t n = ctx_.shard(u), off = shard_offset(u);
  std::vector<float> out(static_cast<size_t>(n));
  if (const char* m = master_at(u, kind)) {  // a bf16 master widens exactly
    compute_.convert(m, master_dtype_, out.data(), DType::f32, n);
    compute_.synchronize();
    return out;
  }
  const bool first = kind == StateKind::state0;
  const size_t sb = cpu::state_bytes(format_);
  const char* src = static_cast<const char*>(first ? s.state0 : s.state1) + size_t(off) * sb;
  if (format_ == StateFormat::f32) {  // where compute_ reaches it (a GPU's memory too)
    compute_.copy(out.data(), src, out.size() * 4);
    compute_.synchronize();
  } else {
    const int64_t block = ctx_.cfg->state_block;
    const float* a = first ? s.absmax0 : s.absmax1;  // q8 only
    if (a) a += off / block;
    std::vector<char> bytes;  // a GPU's moments, copied to the host to widen them there
    std::vector<float> absmax;
    if (!on_cpu_) {
      bytes.resize(size_t(n) * sb);
      compute_.copy(bytes.data(), src, bytes.size());
      if (a) {
        absmax.resize(size_t(n / block));
        compute_.copy(absmax.data(), a, absmax.size() * 4);
      }
      compute_.synchronize();
      src = bytes.data();
      a = a ? absmax.data() : nullptr;
    }
    cpu::widen_moment(arena_.isa(), format_, src, a, n, block, first, out.data());
  }
  return out;
}

std::vector<float> MemoryStateTier::read_grad(int u) {
  if (!spec_.empty()) thread_.settle_first();  // the final micro-step's fold
  const int64_t n = ctx_.shard(u);
  std::vector<float> out(size_t(n), 0.0f);
  auto [g, dt] = grad(u);
  if (!g) return out;  // stage 0 before any gradient was handed over
  const char* src = static_cast<const char*>(g) + size_t(shard_offset(u)) * dtype_size(dt);
  std::vector<char> bytes;  // a GPU's gradient, copied to the host first
  if (!on_cpu_) {
    bytes.resize(size_t(n) * dtype_size(dt));
    compute_.copy(bytes.data(), src, bytes.size());
    compute_.synchronize();
    src = bytes.data();
  }
  cpu::convert(arena_.isa(), src, dt, out.data(), DType::f32, n);
  return out;
}

StoredShard MemoryStateTier::stored(int u, StateKind kind) {
  if (compute_.streams()) return {};
  if (!spec_.empty()) thread_.settle();  // a load may write it in place
  // A bf16 master is saved and loaded as f32 (read() and write() convert it).
  if (char* m = master_at(u, kind))
    return master_dtype_ == DType::f32 ? StoredShard{StateFormat::f32, m, nullptr} : StoredShard{};
  const Unit& s = units_[size_t(u)];
  const bool first = kind == StateKind::state0;
  void* m = first ? s.state0 : kind == StateKind::state1 ? s.state1 : nullptr;
  if (!m) return {};
  const int64_t off = shard_offset(u);
  float* a = first ? s.absmax0 : s.absmax1;  // q8 only
  return {format_, static_cast<char*>(m) + size_t(off) * cpu::state_bytes(format_),
          a ? a + off / ctx_.cfg->state_block : nullptr};
}

void MemoryStateTier::write(int u, StateKind kind, const std::vector<float>& shard) {
  check_kind("write_shard()", u, kind);
  drop_speculation(u);
  ZS_CHECK(int64_t(shard.size()) == ctx_.shard(u));
  Unit& s = units_[size_t(u)];
  const int64_t n = ctx_.shard(u), off = shard_offset(u);
  if (char* m = master_at(u, kind)) {  // a bf16 master rounds to nearest (exact from one)
    compute_.convert(shard.data(), DType::f32, m, master_dtype_, n);
    compute_.synchronize();
    return;
  }
  const bool first = kind == StateKind::state0;
  const size_t sb = cpu::state_bytes(format_);
  char* dst = static_cast<char*>(first ? s.state0 : s.state1) + size_t(off) * sb;
  if (format_ == StateFormat::f32) {
    compute_.copy(dst, shard.data(), shard.size() * 4);
    compute_.synchronize();
  } else {
    const int64_t block = ctx_.cfg->state_block;
    float* a = first ? s.absmax0 : s.absmax1;  // q8 only
    if (a) a += off / block;
    if (on_cpu_) {
      cpu::narrow_moment(arena_.isa(), format_, shard.data(), n, block, first, dst, a);
      return;
    }
    // On a GPU: narrowed on the host, then copied up.
    std::vector<char> bytes(size_t(n) * sb);
    std::vector<float> absmax(a ? size_t(n / block) : 0);
    cpu::narrow_moment(arena_.isa(), format_, shard.data(), n, block, first, bytes.data(),
                       a ? absmax.data() : nullptr);
    compute_.copy(dst, bytes.data(), bytes.size());
    if (a) compute_.copy(a, absmax.data(), absmax.size() * 4);
    compute_.synchronize();
  }
}

void MemoryStateTier::commit(Communicator& comm, ParamSink& sink) {
  drop_speculation();
  std::vector<std::shared_ptr<Work>> works;
  if (ctx_.cfg->stage == 0) {  // whole f32 state on every rank: gather the restored shards
    // No before_collective(): write() waited for the restored shards' copies (mutate_waits.py).
    for (size_t i = 0; i < units_.size(); ++i) {
      const int64_t n = ctx_.shard(int(i)), off = ctx_.shard_rank * n;
      const std::string what = "unit '" + ctx_.unit(int(i)).layout.name + "' (restored state)";
      const Unit& s = units_[i];
      const size_t mb = dtype_size(master_dtype_);
      char* master = static_cast<char*>(s.master);
      works.push_back(comm.all_gather(master + size_t(off) * mb, master, n, master_dtype_, what));
      // Moments move as their bytes: bf16 elements, q8 codes two to an element of bf16 (a
      // shard is a whole number of blocks, so even), and each absmax array as f32.
      const DType wire = format_ == StateFormat::f32 ? DType::f32 : DType::bf16;
      const int64_t wn = format_ == StateFormat::q8 ? n / 2 : n;
      const size_t sb = cpu::state_bytes(format_);
      for (void* m : {s.state0, s.state1}) {
        if (!m) continue;
        char* c = static_cast<char*>(m);
        works.push_back(comm.all_gather(c + size_t(off) * sb, c, wn, wire, what));
      }
      const int64_t block = ctx_.cfg->state_block;
      for (float* a : {s.absmax0, s.absmax1})
        if (a) works.push_back(comm.all_gather(a + off / block, a, n / block, DType::f32, what));
    }
  }
  for (auto& w : works) w->wait();
  // The parameters are rounded from the master where the master lives.
  for (size_t i = 0; i < units_.size(); ++i) {
    const int u = int(i);
    if (void* out = sink.target(u)) {
      compute_.convert(units_[i].master, master_dtype_, out, ctx_.pdt, ctx_.extent(u));
      sink.done(u);
    } else if (!units_[i].master_buf.empty()) {
      sink.restore(u, read(u, StateKind::master).data());  // parameters off this memory
    }
  }
}

}  // namespace zeroshard
