// The optimizer state on nvme (see nvme_state_tier.hpp): set-up, initial values, the gradient
// cache, the swap-pipelined update with its all-or-nothing commit, and state access from disk.
// Its speculative step is in nvme_speculation.cpp.
#include "src/tiers/nvme_state_tier.hpp"

#include <algorithm>
#include <cstring>

#include "base/agree.hpp"
#include "base/check.hpp"
#include "kernels/cpu/grad_passes.hpp"
#include "kernels/cpu/quant_code.hpp"
#include "kernels/cpu/update_tasks.hpp"
#include "offload/io_backend.hpp"
#include "offload/swap_pipeline.hpp"

namespace zeroshard::offload {
namespace {

size_t a4k(size_t n) {
  return (n + 4095) / 4096 * 4096;
}

void erase_id(std::deque<int>& d, int id) {
  auto it = std::find(d.begin(), d.end(), id);
  if (it != d.end()) d.erase(it);
}

}  // namespace

NvmeStateTier::Record NvmeStateTier::record(int u) const {
  Record r;
  const size_t S = size_t(ctx_.shard(u));
  const StateFormat f = ctx_.cfg->optimizer_state;
  r.sec = a4k(S * dtype_size(ctx_.master_dtype()));
  const size_t block = size_t(ctx_.cfg->state_block);
  r.absmax_off = S * cpu::state_bytes(f);
  // q8: one f32 per block (shards are whole blocks, see padding_grain()).
  if (f == StateFormat::q8) ZS_CHECK(S % block == 0);
  r.mbytes = r.absmax_off + (f == StateFormat::q8 ? S / block * 4 : 0);
  r.msec = a4k(r.mbytes);
  r.record = r.sec + r.msec * size_t(ctx_.num_states);
  r.grad_off = r.record;
  r.grad_sec = a4k(S * (ctx_.accumulation() > 1 ? 4 : ctx_.pbytes));
  r.lowp_off = r.grad_off + r.grad_sec;
  r.lowp_sec = writes_params_ ? a4k(S * ctx_.pbytes) : 0;
  r.total = r.lowp_off + r.lowp_sec;
  return r;
}

std::string NvmeStateTier::who() const {
  return "rank " + std::to_string(ctx_.rank) + ": nvme swap ";
}

NvmeStateTier::NvmeStateTier(const TierContext& ctx, cpu::Arena& arena, SwapSpace& space,
                             bool writes_params, Speculative speculative)
    : ctx_(ctx),
      arena_(arena),
      space_(space),
      writes_params_(writes_params),
      units_(ctx.units->size()) {
  const Config& cfg = *ctx.cfg;
  const size_t gbytes = ctx.accumulation() > 1 ? 4 : ctx.pbytes;
  store_ = SwapStore("optimizer state", "optim.swap", space.dirs(cfg.offload_optimizer.nvme_paths),
                     cfg.aio.block_size);
  int64_t max_shard = 0, sum_shard = 0, moment_bytes = 0;
  size_t max_slot = 0;
  for (size_t i = 0; i < units_.size(); ++i) {
    const Record L = record(int(i));
    const int64_t S = ctx.shard(int(i));
    units_[i].rec[0] = store_.add_extent(L.record);
    units_[i].rec[1] = store_.add_extent(L.record);
    units_[i].grad = store_.add_extent(size_t(S) * gbytes);
    max_shard = std::max(max_shard, S);
    max_slot = std::max(max_slot, L.total);
    sum_shard += S;
    moment_bytes += int64_t(L.mbytes);
  }
  store_.open(!ctx.plan_only && testing::hooks().preallocate);
  const int count = cfg.offload_optimizer.buffer_count;
  const bool pin = cfg.offload_optimizer.pin_memory;
  swap_pool_ = PinnedPool(ctx.ledger, "swap_staging", count, max_slot, pin);
  // Gradient cache: reduce-scatter output, then (accumulation) the f32 sum.
  grad_acc_off_ = a4k(size_t(max_shard) * ctx.pbytes);
  grad_cache_ =
      PinnedPool(ctx.ledger, "grad_cache", cfg.grad_buffers + 1,
                 grad_acc_off_ + (ctx.accumulation() > 1 ? a4k(size_t(max_shard) * 4) : 0), pin);
  read_ahead_ = cfg.swap_read_ahead > 0 ? cfg.swap_read_ahead : std::max(1, count - 2);
  read_ahead_ = std::min(read_ahead_, count - 1);
  // The ledger's nvme column: one slot of each state (what the tier holds), and the rest of the
  // file (the second record slots and alignment) as "swap_reserve".
  int64_t logical = 0;
  auto charge = [&](MemKind kind, const char* name, int64_t bytes) {
    if (bytes <= 0) return;
    charges_.push_back(std::make_unique<DiskCharge>(ctx.ledger, kind, name, bytes));
    logical += bytes;
  };
  charge(MemKind::master, "master", sum_shard * int64_t(dtype_size(ctx.master_dtype())));
  charge(MemKind::optim_state, "optim_state", int64_t(ctx.num_states) * moment_bytes);
  charge(MemKind::grad, "grad", sum_shard * int64_t(gbytes));
  charge(MemKind::buffer, "swap_reserve", int64_t(store_.file_bytes()) - logical);
  space.add(&store_);
  space.add(&swap_pool_);
  space.add(&grad_cache_);
  if (speculative == Speculative::off) return;
  // The parameters' shards on disk are stored before the state may change: no speculation.
  ZS_CHECK(!writes_params);
  spec_ = std::vector<Speculation>(units_.size());  // built in place: they hold an atomic
  if (speculative == Speculative::own_out)
    for (size_t i = 0; i < units_.size(); ++i)
      spec_[i].own_out = ctx.buffer(Tier::host, MemKind::buffer, "param_speculative",
                                    size_t(ctx.shard(int(i))) * ctx.pbytes, false);
  quiesce_key_ = space.before_stop([this] { drop_speculation(); });  // its I/O is in the ring
}

NvmeStateTier::~NvmeStateTier() {
  drop_speculation();  // done already where the swap space stopped (its before_stop())
  if (!spec_.empty()) space_.forget_before_stop(quiesce_key_);  // a tier gone before the space
}

std::vector<std::pair<void*, size_t>> NvmeStateTier::dma_regions() const {
  std::vector<std::pair<void*, size_t>> out;  // reduced shards land here from the GPU
  for (int i = 0; i < grad_cache_.count(); ++i)
    out.push_back({grad_cache_.data(i), grad_cache_.bytes()});
  return out;
}

// Initial values go through f32 once, as in memory: the record's master is the shard of
// `whole` (bf16: rounded to nearest), its optimizer state zero (q8: codes of 0, absmax 0).
// Writes overlap (one per free staging slot).
void NvmeStateTier::load_initial(int u, const float* whole) {
  const int s = init_writes_.slot(space_.io());
  const int64_t S = ctx_.shard(u);
  const Record L = record(u);
  char* b = swap_pool_.data(s);
  std::memset(b, 0, L.record);
  if (whole)
    cpu::convert(arena_.isa(), whole + ctx_.extent_start(u), DType::f32, b, ctx_.master_dtype(), S);
  std::vector<Piece> ps;
  store_.pieces(units_[size_t(u)].rec[0], b, &swap_pool_, true, ps);
  const std::string what = "rank " + std::to_string(ctx_.rank) +
                           ": nvme swap: writing the initial optimizer state of unit '" +
                           ctx_.unit(u).layout.name + "'";
  init_writes_.submit(space_.io(), std::move(ps), what, s);
  units_[size_t(u)].cur = 0;
}

void NvmeStateTier::finish_load() {
  init_writes_.finish(space_.io());
}

// ---- the gradient cache ----------------------------------------------------------------------

void NvmeStateTier::reap(bool block) {
  while (!evicting_.empty()) {
    Unit& v = units_[size_t(evicting_.front())];
    if (!block && !v.grad_write->done()) return;
    space_.io().settle(*v.grad_write);
    if (!deferred_) deferred_ = v.grad_write->error();
    v.grad_write.reset();
    grad_cache_.release(v.wslot);
    v.wslot = -1;
    evicting_.pop_front();
    block = false;
  }
}

// The oldest cached gradient no speculation is about to read goes first; then one whose
// speculation has not started (that speculation is dropped); never one being read.
bool NvmeStateTier::evict(int keep) {
  int victim = -1;
  for (int pass = 0; pass < 2 && victim < 0; ++pass)
    for (int v : grad_fifo_) {
      const int st = spec_.empty() ? kNone : spec_[size_t(v)].state.load();
      if (v != keep && (st == kNone || st == kDone || (pass == 1 && evictable(v)))) {
        victim = v;
        break;
      }
    }
  if (victim < 0) return false;
  const int v = victim;
  // Its reduction must have landed (it usually has, long ago). Landing now hands the unit to
  // its speculation, which must not read the slot given up here: dropped if it has not
  // started, waited for if it has.
  ctx_.finish_reduction(v);
  if (!spec_.empty() && !evictable(v)) wait_read(v);
  Unit& w = units_[size_t(v)];
  char* slot = grad_cache_.data(w.gslot);
  char* data = ctx_.accumulation() > 1 ? slot + grad_acc_off_ : slot;
  std::vector<Piece> ps;
  store_.pieces(w.grad, data, &grad_cache_, true, ps);
  w.grad_write = space_.io().submit(
      std::move(ps), who() + "write of the gradient of unit '" + ctx_.unit(v).layout.name + "'");
  w.wslot = w.gslot;
  w.gslot = -1;
  w.grad_on_disk = true;
  erase_id(grad_fifo_, v);
  evicting_.push_back(v);
  return true;
}

// The unit's reduce-scatter lands in its cache slot. Under accumulation a unit keeps its slot
// across micro-steps (the sum lives there) unless it was evicted meanwhile.
void* NvmeStateTier::grad_target(int u) {
  Unit& w = units_[size_t(u)];
  if (w.gslot < 0) {
    reap(false);
    for (;;) {
      w.gslot = grad_cache_.try_acquire();
      if (w.gslot >= 0) break;
      if (!evicting_.empty()) {
        reap(true);
      } else if (!evict(u)) {  // the one other slot is being read by a speculation
        for (size_t v = 0; v < spec_.size(); ++v) wait_read(int(v));
        ZS_CHECK(evict(u));
      }
    }
    grad_fifo_.push_back(u);
  }
  void* target = grad_cache_.data(w.gslot);
  // Keep a slot free for the next unit: its eviction then overlaps this unit's reduction.
  if (grad_cache_.free_count() == 0 && evicting_.empty()) evict(u);
  return target;
}

void NvmeStateTier::read_back(int u, float* acc) {
  Unit& w = units_[size_t(u)];
  if (w.grad_write) {  // still being written: wait for it first
    space_.io().settle(*w.grad_write);
    if (!deferred_) deferred_ = w.grad_write->error();
    w.grad_write.reset();
    grad_cache_.release(w.wslot);
    w.wslot = -1;
    erase_id(evicting_, u);
  }
  std::vector<Piece> ps;
  store_.pieces(w.grad, reinterpret_cast<char*>(acc), &grad_cache_, false, ps);
  auto rd = space_.io().submit(std::move(ps), who() + "read of the accumulated gradient of unit '" +
                                                  ctx_.unit(u).layout.name + "'");
  space_.io().settle(*rd);
  if (!deferred_) deferred_ = rd->error();  // reported at step(), on every rank
  w.grad_on_disk = false;
}

// The reduce-scatter output is in the unit's slot. Accumulate it (reading an evicted partial sum
// back first) and, once final, take its sum of squares for the norm.
void NvmeStateTier::grad_reduced(int u, int micro, const void*) {
  Unit& w = units_[size_t(u)];
  const int64_t S = ctx_.shard(u);
  ZS_CHECK(w.gslot >= 0);
  char* slot = grad_cache_.data(w.gslot);
  if (ctx_.accumulation() == 1) {
    w.sumsq = cpu::parallel_sum_squares(arena_, slot, ctx_.pdt, S);
    return;
  }
  float* acc = reinterpret_cast<float*>(slot + grad_acc_off_);
  if (micro > 0 && w.grad_on_disk) read_back(u, acc);
  const bool final = micro + 1 == ctx_.accumulation();
  const double s = cpu::fold_grad(arena_, acc, slot, ctx_.pdt, S, micro == 0, final);
  if (final) w.sumsq = s;
}

std::optional<Error> NvmeStateTier::settle_grads() {
  settle_evictions();
  std::optional<Error> e = std::move(deferred_);
  deferred_.reset();
  return e;
}

// The gradients being written out land (a failure is kept in deferred_ for settle_grads()).
void NvmeStateTier::settle_evictions() {
  for (int v : evicting_) {
    Unit& w = units_[size_t(v)];
    space_.io().settle(*w.grad_write);
    if (!deferred_) deferred_ = w.grad_write->error();
    w.grad_write.reset();
    grad_cache_.release(w.wslot);
    w.wslot = -1;
  }
  evicting_.clear();
}

void NvmeStateTier::forget_grads() {
  drop_speculation();
  counted_ = {};  // the step ends here (skipped)
  counted_.dropped = std::exchange(dropped_early_, 0);
  forget();
}

void NvmeStateTier::forget() {
  settle_grads();
  for (Unit& w : units_) {
    if (w.gslot >= 0) grad_cache_.release(w.gslot);
    w.gslot = -1;
    w.grad_on_disk = false;
    w.sumsq = 0;
  }
  grad_fifo_.clear();
}

double NvmeStateTier::sum_squares() {
  double s = 0.0;
  for (const Unit& w : units_) s += w.sumsq;  // unit order, as the in-memory path sums
  return s;
}

// ---- the optimizer step ------------------------------------------------------------------------

char* NvmeStateTier::cached_grad(int u) const {
  const Unit& w = units_[size_t(u)];
  ZS_CHECK(w.gslot >= 0);
  return grad_cache_.data(w.gslot) + (ctx_.accumulation() > 1 ? grad_acc_off_ : 0);
}

cpu::UnitUpdate NvmeStateTier::unit_update(int u, char* base, const void* grad, void* out,
                                           int64_t step) const {
  const Record L = record(u);
  cpu::UnitUpdate uu;
  uu.runs = &ctx_.unit(u).shard_runs;
  uu.args.master = base;
  uu.args.master_dtype = ctx_.master_dtype();
  uu.args.round_key = cpu::rounding_key(step, u);
  uu.args.index = ctx_.extent_start(u);
  uu.args.state_format = ctx_.cfg->optimizer_state;
  uu.args.block = ctx_.cfg->state_block;
  const bool q8 = uu.args.state_format == StateFormat::q8;
  if (ctx_.num_states >= 1) {
    char* m = base + L.offset(StateKind::state0);
    uu.args.state0 = m;
    if (q8) uu.args.absmax0 = reinterpret_cast<float*>(m + L.absmax_off);
  }
  if (ctx_.num_states >= 2) {
    char* m = base + L.offset(StateKind::state1);
    uu.args.state1 = m;
    if (q8) uu.args.absmax1 = reinterpret_cast<float*>(m + L.absmax_off);
  }
  uu.args.grad = grad;
  uu.args.grad_dtype = grad_dtype();
  if (out) {
    uu.args.out = out;
    uu.args.out_dtype = ctx_.pdt;
  }
  uu.args.n = ctx_.shard(u);
  return uu;
}

// Reads unit k+1 … k+read_ahead while unit k is updated in its slot and unit k−1 is written back
// to the other record slot. Commits (flips every unit's slot) only when every rank wrote every
// unit; otherwise restores the low-precision parameters it changed in memory and throws. A unit
// whose speculation is kept is not read, updated or written: its record is in the other slot
// already, and its new values go to the sink in unit order with the others'.
void NvmeStateTier::update(const std::vector<cpu::UpdateHyper>& hyper, int64_t step,
                           ParamSink& sink) {
  ZS_CHECK(sink.takes_writes() == writes_params_);
  const std::string in_step = " in step " + std::to_string(step);
  std::vector<bool> keep(units_.size(), false);
  counted_ = {};
  counted_.dropped = std::exchange(dropped_early_, 0);
  if (!spec_.empty()) {
    // Those the step will not keep are cancelled first: a step that keeps none (it clips)
    // waits only for the one the thread is running.
    for (size_t i = 0; i < spec_.size(); ++i) {
      Speculation& sp = spec_[i];
      if (sp.state == kNone) continue;
      keep[i] = matches(int(i), hyper, step);
      int queued = kQueued;
      if (!keep[i] && sp.state.compare_exchange_strong(queued, kNone)) ++counted_.dropped;
    }
    thread_.settle();
    (void)thread_.take_failure();  // a failed speculation is not written: updated below
    drain_spec_writes();
    for (size_t i = 0; i < spec_.size(); ++i) {
      Speculation& sp = spec_[i];
      if (sp.state == kNone) continue;
      keep[i] = keep[i] && sp.written;
      ++(keep[i] ? counted_.kept : counted_.dropped);
      sp.state = kNone;
      sp.written = false;
    }
  }
  std::vector<int> pipelined;  // the units the pipeline updates (not kept)
  for (size_t i = 0; i < units_.size(); ++i)
    if (!keep[i]) pipelined.push_back(int(i));
  int handed = 0;  // units below it went to the sink (their new values in its memory)
  auto hand_kept = [&](int end) {
    for (; handed < end; ++handed)
      if (keep[size_t(handed)]) keep_speculation(handed, sink);
  };
  std::vector<cpu::UpdateTask> tasks;
  int exchanged = 0;  // units whose Muon direction was made (TierContext::direction)
  PipelineHooks h;
  h.read = [&](int k, int slot) {
    const int i = pipelined[size_t(k)];
    Unit& w = units_[size_t(i)];
    char* base = swap_pool_.data(slot);
    std::vector<Piece> ps;
    store_.pieces(w.rec[w.cur], base, &swap_pool_, false, ps);
    if (w.gslot < 0) {
      ZS_CHECK(w.grad_on_disk);
      store_.pieces(w.grad, base + record(i).grad_off, &swap_pool_, false, ps);
    }
    return std::vector<std::shared_ptr<IoBatch>>{
        space_.io().submit(std::move(ps), who() + "read of unit '" + ctx_.unit(i).layout.name +
                                              "' (optimizer state, slot " + std::to_string(w.cur) +
                                              ", and gradient)" + in_step)};
  };
  h.update = [&](int k, int slot) {
    const int i = pipelined[size_t(k)];
    hand_kept(i);
    Unit& w = units_[size_t(i)];
    const Record L = record(i);
    char* base = swap_pool_.data(slot);
    void* out = writes_params_ ? base + L.lowp_off : sink.target(i);
    if (writes_params_) zero_padding(ctx_.unit(i), base + L.lowp_off, ctx_.pbytes);
    cpu::UnitUpdate uu =
        unit_update(i, base, w.gslot >= 0 ? cached_grad(i) : base + L.grad_off, out, step);
    if (ctx_.direction) {
      uu.args.dir = ctx_.direction(i, uu.args);
      ++exchanged;
    }
    tasks.clear();
    cpu::append_update_tasks(hyper, uu, tasks);
    cpu::run_update_tasks(arena_, tasks);
    if (!writes_params_) sink.done(i);
    handed = i + 1;
    if (w.gslot >= 0) {  // the cached gradient is spent
      grad_cache_.release(w.gslot);
      w.gslot = -1;
      erase_id(grad_fifo_, i);
    }
  };
  h.write = [&](int k, int slot) {
    const int i = pipelined[size_t(k)];
    Unit& w = units_[size_t(i)];
    char* base = swap_pool_.data(slot);
    std::vector<Piece> ps;
    wait_unpinned(i, 1 - w.cur);
    store_.pieces(w.rec[1 - w.cur], base, &swap_pool_, true, ps);
    std::vector<std::shared_ptr<IoBatch>> out{
        space_.io().submit(std::move(ps), who() + "write of unit '" + ctx_.unit(i).layout.name +
                                              "' (optimizer state, slot " +
                                              std::to_string(1 - w.cur) + ")" + in_step)};
    if (writes_params_) out.push_back(sink.write(i, base + record(i).lowp_off, &swap_pool_, step));
    return out;
  };
  const PipelineResult pr =
      run_pipeline(space_.io(), swap_pool_, int(pipelined.size()), read_ahead_, h);
  if (!pr.error) hand_kept(int(units_.size()));
  // A pipeline stopped by this rank's I/O error still takes part in the other units' Muon
  // exchanges (with nothing to contribute), which the other ranks are in: then all agree.
  // (Muon takes no speculation: pipelined holds every unit.)
  for (int k = exchanged; ctx_.direction && pr.error && k < int(pipelined.size()); ++k) {
    const int i = pipelined[size_t(k)];
    cpu::UpdateArgs none;
    none.n = ctx_.shard(i);
    ctx_.direction(i, none);
  }
  std::optional<Error> failed =
      agree(*ctx_.comm, pr.error, "step " + std::to_string(step) + " (nvme swap)");
  forget();
  if (!failed) {
    for (Unit& w : units_) w.cur = 1 - w.cur;
    if (writes_params_) sink.commit_writes();
    return;
  }
  std::string restore_error;
  if (!writes_params_) restore_params(handed, sink, restore_error);
  throw Error(failed->code(), std::string(failed->what()) + not_applied(step) + restore_error);
}

// Parameters kept in memory were overwritten for the units already updated: rebuild them from
// the master weights of the committed slot, which this step never wrote.
void NvmeStateTier::restore_params(int updated, ParamSink& sink, std::string& errors) {
  for (int i = 0; i < updated; ++i) {
    try {
      sink.restore(i, read(i, StateKind::master).data());
    } catch (const Error& e) {
      errors += std::string("; restoring the parameters of unit '") + ctx_.unit(i).layout.name +
                "' from their last committed master weights failed too, so they are wrong in "
                "memory (the optimizer state on disk is intact): " +
                e.what();
    }
  }
}

void NvmeStateTier::preview(const std::vector<cpu::UpdateHyper>&, int64_t, int, void*) {
  // The parameters' two-phase store is for state in memory; on nvme the new shards are written
  // with the records (see update()).
  ZS_THROW(internal, "preview() of the nvme state tier");
}

// ---- state access ------------------------------------------------------------------------------

void NvmeStateTier::check_kind(const char* call, int u, StateKind kind) const {
  const int moment = kind == StateKind::state0 ? 1 : kind == StateKind::state1 ? 2 : 0;
  if (kind == StateKind::param || moment > ctx_.num_states)
    ZS_THROW(invalid_argument, call << ": " << ctx_.where(u) << ": optimizer "
                                    << optimizer_name(ctx_.cfg->optimizer.kind)
                                    << " keeps no such state");
}

void NvmeStateTier::widen(int u, const char* rec, StateKind kind, float* out) const {
  const Record L = record(u);
  const int64_t S = ctx_.shard(u);
  const char* p = rec + L.offset(kind);
  const StateFormat f = ctx_.cfg->optimizer_state;
  if (kind == StateKind::master) {  // a bf16 master widens exactly
    cpu::convert(arena_.isa(), p, ctx_.master_dtype(), out, DType::f32, S);
    return;
  }
  const float* absmax =
      f == StateFormat::q8 ? reinterpret_cast<const float*>(p + L.absmax_off) : nullptr;
  cpu::widen_moment(arena_.isa(), f, p, absmax, S, ctx_.cfg->state_block, kind == StateKind::state0,
                    out);
}

std::vector<float> NvmeStateTier::read(int u, StateKind kind) const {
  check_kind("read_shard()", u, kind);
  const Unit& w = units_[size_t(u)];
  const Record L = record(u);
  // A transient buffer, but a byte held all the same.
  Buffer tmp(ctx_.ledger, Tier::host, MemKind::buffer, "swap_readback", L.record);
  std::vector<Piece> ps;
  store_.pieces(w.rec[w.cur], tmp.as<char>(), nullptr, false, ps);
  auto b = space_.io().submit(std::move(ps), who() + "read of unit '" + ctx_.unit(u).layout.name +
                                                 "' (optimizer state, slot " +
                                                 std::to_string(w.cur) + ")");
  space_.io().wait(*b);
  std::vector<float> out(static_cast<size_t>(ctx_.shard(u)));
  widen(u, tmp.as<char>(), kind, out.data());
  return out;
}

std::vector<float> NvmeStateTier::read_grad(int u) {
  Unit& w = units_[size_t(u)];
  const int64_t S = ctx_.shard(u);
  const DType gdt = ctx_.accumulation() > 1 ? DType::f32 : ctx_.pdt;
  std::vector<float> out(size_t(S), 0.0f);
  if (w.gslot >= 0) {
    const char* g = grad_cache_.data(w.gslot) + (ctx_.accumulation() > 1 ? grad_acc_off_ : 0);
    cpu::convert(arena_.isa(), g, gdt, out.data(), DType::f32, S);
    return out;
  }
  if (!w.grad_on_disk) return out;
  settle_evictions();  // an eviction still being written lands first
  Buffer tmp(ctx_.ledger, Tier::host, MemKind::buffer, "swap_readback",
             size_t(round_up(S * int64_t(dtype_size(gdt)), 4096)));
  std::vector<Piece> ps;
  store_.pieces(w.grad, tmp.as<char>(), nullptr, false, ps);
  auto rd = space_.io().submit(
      std::move(ps), who() + "read of the gradient of unit '" + ctx_.unit(u).layout.name + "'");
  space_.io().wait(*rd);
  cpu::convert(arena_.isa(), tmp.data(), gdt, out.data(), DType::f32, S);
  return out;
}

// Restoring one state of one unit: the record is rewritten whole into the other slot and that
// unit's slot flipped, so a failure leaves the unit as it was. Moments are narrowed to their
// format (q8: the shard's blocks requantized, which gives a read_shard()'s bits back).
void NvmeStateTier::write(int u, StateKind kind, const std::vector<float>& v) {
  check_kind("write_shard()", u, kind);
  drop_speculation(u);  // it wrote the slot this write takes
  ZS_CHECK(int64_t(v.size()) == ctx_.shard(u));
  Unit& w = units_[size_t(u)];
  const Record L = record(u);
  Buffer tmp(ctx_.ledger, Tier::host, MemKind::buffer, "swap_readback", L.record);
  const std::string name = ctx_.unit(u).layout.name;
  std::vector<Piece> ps;
  store_.pieces(w.rec[w.cur], tmp.as<char>(), nullptr, false, ps);
  auto rd = space_.io().submit(
      std::move(ps), who() + "read of unit '" + name + "' (optimizer state) for write_shard()");
  space_.io().wait(*rd);
  char* p = tmp.as<char>() + L.offset(kind);
  const StateFormat f = ctx_.cfg->optimizer_state;
  if (kind == StateKind::master)  // a bf16 master rounds to nearest (exact from one)
    cpu::convert(arena_.isa(), v.data(), DType::f32, p, ctx_.master_dtype(), int64_t(v.size()));
  else
    cpu::narrow_moment(arena_.isa(), f, v.data(), int64_t(v.size()), ctx_.cfg->state_block,
                       kind == StateKind::state0, p,
                       f == StateFormat::q8 ? reinterpret_cast<float*>(p + L.absmax_off) : nullptr);
  wait_unpinned(u, 1 - w.cur);
  ps.clear();
  store_.pieces(w.rec[1 - w.cur], tmp.as<char>(), nullptr, true, ps);
  auto wr = space_.io().submit(
      std::move(ps), who() + "write of unit '" + name + "' (optimizer state) for write_shard()");
  space_.io().wait(*wr);
  w.cur = 1 - w.cur;
}

// ---- snapshots ---------------------------------------------------------------------------------

class NvmeStateTier::Snapshot final : public StateSnapshot {
 public:
  Snapshot(const NvmeStateTier& t) : t_(t), pins_(t.pins_) {
    size_t most = 0, most_shard = 0;
    for (size_t u = 0; u < t.units_.size(); ++u) {
      extent_.push_back(t.units_[u].rec[t.units_[u].cur]);
      most = std::max(most, t.record(int(u)).record);
      most_shard = std::max(most_shard, size_t(t.ctx_.shard(int(u))));
    }
    record_ = Buffer(t.ctx_.ledger, Tier::host, MemKind::buffer, "checkpoint_snapshot", most);
    // Compact moments and a bf16 master are seen in f32.
    auto widened = [&](int k) {
      wide_[k] =
          Buffer(t.ctx_.ledger, Tier::host, MemKind::buffer, "checkpoint_snapshot", most_shard * 4);
    };
    if (t.ctx_.cfg->optimizer_state != StateFormat::f32)
      for (int k = 0; k < t.ctx_.num_states; ++k) widened(k);
    if (t.ctx_.master_dtype() != DType::f32) widened(2);
    std::lock_guard<std::mutex> lock(pins_->mu);
    for (size_t u = 0; u < t.units_.size(); ++u) pins_->slot[u] = t.units_[u].cur;
  }
  ~Snapshot() override { release(int(extent_.size())); }

  const float* view(int u, StateKind kind) override {
    ZS_CHECK(u >= released_ || u == viewed_);
    if (u != viewed_) {
      release(u);
      t_.store_.read_now(extent_[size_t(u)], record_.as<char>());
      viewed_ = u;
      widened_[0] = widened_[1] = widened_[2] = false;
      release(u + 1);  // in record_ now: the tier may write over it
    }
    const char* rec = record_.as<char>();
    const int k = kind == StateKind::master ? 2 : kind == StateKind::state1 ? 1 : 0;
    if (wide_[k].empty()) return reinterpret_cast<const float*>(rec + t_.record(u).offset(kind));
    if (!widened_[k]) t_.widen(u, rec, kind, wide_[k].as<float>());
    widened_[k] = true;
    return wide_[k].as<float>();
  }

 private:
  void release(int below) {
    {
      std::lock_guard<std::mutex> lock(pins_->mu);
      for (; released_ < below; ++released_) pins_->slot[size_t(released_)] = -1;
    }
    pins_->cv.notify_all();
  }

  const NvmeStateTier& t_;  // its layout and store only: those do not change while it trains
  std::shared_ptr<Pins> pins_;
  std::vector<int> extent_;  // each unit's committed record slot
  Buffer record_;            // the unit viewed last
  Buffer wide_[3];  // compact moments, a bf16 master: state0, state1, master of that unit in f32
  bool widened_[3] = {false, false, false};
  int viewed_ = -1, released_ = 0;
};

std::unique_ptr<StateSnapshot> NvmeStateTier::snapshot() {
  {
    std::lock_guard<std::mutex> lock(pins_->mu);
    pins_->slot.resize(units_.size(), -1);
    for (int s : pins_->slot)
      if (s >= 0) ZS_THROW(internal, who() << "a second snapshot while one is being read");
  }
  return std::make_unique<Snapshot>(*this);
}

void NvmeStateTier::wait_unpinned(int u, int slot) {
  std::unique_lock<std::mutex> lock(pins_->mu);
  pins_->cv.wait(lock,
                 [&] { return size_t(u) >= pins_->slot.size() || pins_->slot[size_t(u)] != slot; });
}

// The low-precision parameters rebuilt from the master weights on disk.
void NvmeStateTier::commit(Communicator&, ParamSink& sink) {
  drop_speculation();
  for (size_t i = 0; i < units_.size(); ++i)
    sink.restore(int(i), read(int(i), StateKind::master).data());
}

}  // namespace zeroshard::offload
