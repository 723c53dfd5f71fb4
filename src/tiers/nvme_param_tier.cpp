// Stage 3's parameter shards on nvme (see nvme_param_tier.hpp).
#include "src/tiers/nvme_param_tier.hpp"

#include <algorithm>
#include <cstring>

#include "base/agree.hpp"
#include "base/check.hpp"
#include "offload/swap_pipeline.hpp"

namespace zeroshard::offload {

NvmeParamTier::NvmeParamTier(const TierContext& ctx, cpu::Arena& arena, SwapSpace& space,
                             bool state_in_memory)
    : ctx_(ctx),
      arena_(arena),
      space_(space),
      state_in_memory_(state_in_memory),
      units_(ctx.units->size()) {
  const Config& cfg = *ctx.cfg;
  store_ = SwapStore("parameters", "param.swap", space.dirs(cfg.offload_param.nvme_paths),
                     cfg.aio.block_size);
  int64_t max_shard = 0, sum_shard = 0;
  for (size_t i = 0; i < units_.size(); ++i) {
    const int64_t s = ctx.shard(int(i));
    units_[i].slot[0] = store_.add_extent(size_t(s) * ctx.pbytes);
    units_[i].slot[1] = store_.add_extent(size_t(s) * ctx.pbytes);
    max_shard = std::max(max_shard, s);
    sum_shard += s;
  }
  store_.open(!ctx.plan_only && testing::hooks().preallocate);
  pool_ = PinnedPool(ctx.ledger, "param_staging", cfg.offload_param.buffer_count,
                     size_t(max_shard) * ctx.pbytes, cfg.offload_param.pin_memory);
  // The ledger's nvme column: one slot of each shard (what the tier holds), and the rest of the
  // file (the second slots and alignment) as "swap_reserve".
  const int64_t held = sum_shard * int64_t(ctx.pbytes);
  charges_.push_back(std::make_unique<DiskCharge>(ctx.ledger, MemKind::param, "param", held));
  charges_.push_back(std::make_unique<DiskCharge>(ctx.ledger, MemKind::buffer, "swap_reserve",
                                                  int64_t(store_.file_bytes()) - held));
  space.add(&store_);
  space.add(&pool_);
}

std::string NvmeParamTier::who() const {
  return "rank " + std::to_string(ctx_.rank) + ": nvme swap ";
}

// Initial values: the shard rounded from the f32 master values, written to slot 0. Writes
// overlap, one per free staging slot; finish_load() waits for them all.
void NvmeParamTier::load_initial(int u, const float* whole) {
  const int s = init_writes_.slot(space_.io());
  char* b = pool_.data(s);
  std::memset(b, 0, pool_.bytes());
  const int64_t n = ctx_.shard(u);
  if (whole) cpu::convert(arena_.isa(), whole + ctx_.shard_rank * n, DType::f32, b, ctx_.pdt, n);
  std::vector<Piece> ps;
  store_.pieces(units_[size_t(u)].slot[0], b, &pool_, true, ps);
  const std::string what = "rank " + std::to_string(ctx_.rank) +
                           ": nvme swap: writing the initial parameters of unit '" +
                           ctx_.unit(u).layout.name + "'";
  init_writes_.submit(space_.io(), std::move(ps), what, s);
  units_[size_t(u)].cur = 0;
}

void NvmeParamTier::finish_load() {
  init_writes_.finish(space_.io());
}

std::shared_ptr<IoBatch> NvmeParamTier::read_into(int u, int slot, const std::string& why) {
  Unit& w = units_[size_t(u)];
  std::vector<Piece> ps;
  store_.pieces(w.slot[w.cur], pool_.data(slot), &pool_, false, ps);
  w.pslot = slot;
  return space_.io().submit(std::move(ps), who() + "read of unit '" + ctx_.unit(u).layout.name +
                                               "' (parameters, slot " + std::to_string(w.cur) +
                                               why + ")");
}

// The unit's shard, read from its committed slot (usually read ahead already). Ranks agree on
// the outcome before the all-gather, so a failed read fails gather() on every rank (one small
// all-reduce per gathered unit) instead of feeding peers garbage or hanging.
const void* NvmeParamTier::gather_source(int u) {
  Unit& w = units_[size_t(u)];
  if (w.pslot < 0) {
    int slot = pool_.try_acquire();
    // Take back a read-ahead of a unit the engine is not gathering.
    for (size_t v = 0; slot < 0 && v < units_.size(); ++v) {
      Unit& x = units_[v];
      if (int(v) == u || x.pslot < 0 || x.held) continue;
      if (x.pread) space_.io().settle(*x.pread);
      x.pread.reset();
      pool_.release(x.pslot);
      x.pslot = -1;
      slot = pool_.try_acquire();
    }
    if (slot < 0) return nullptr;  // the engine ends a prefetched gather and asks again
    w.pread = read_into(u, slot, ") for gather(");
  }
  w.held = true;
  std::optional<Error> mine;
  if (w.pread) {
    space_.io().settle(*w.pread);
    mine = w.pread->error();
    w.pread.reset();
  }
  if (std::optional<Error> e =
          agree(*ctx_.comm, mine, "gather() of unit '" + ctx_.unit(u).layout.name + "'")) {
    pool_.release(w.pslot);
    w.pslot = -1;
    w.held = false;
    throw Error(e->code(), std::string(e->what()) +
                               "; the parameters on disk are those of the last completed step");
  }
  return pool_.data(w.pslot);
}

void NvmeParamTier::gathered(int u) {
  Unit& w = units_[size_t(u)];
  if (w.pslot >= 0 && !w.pread) {
    pool_.release(w.pslot);
    w.pslot = -1;
  }
}

// Starts reading the units gathered next while staging slots allow (one stays free for a
// gather that must read synchronously), so the drive works ahead of the prefetched all-gather.
void NvmeParamTier::read_ahead(const std::vector<int>& order, size_t pos) {
  const size_t window = size_t(pool_.count());
  for (size_t p = pos; p < order.size() && p < pos + window; ++p) {
    if (pool_.free_count() <= 1) return;
    Unit& w = units_[size_t(order[p])];
    if (w.held || w.pslot >= 0) continue;
    w.pread = read_into(order[p], pool_.try_acquire(), ", read ahead");
  }
}

// Before a step changes the committed slots: reads ahead hold the old parameters.
void NvmeParamTier::drop_reads() {
  for (Unit& w : units_) {
    if (w.pread) {
      space_.io().settle(*w.pread);
      w.pread.reset();
    }
    if (w.pslot >= 0) {
      pool_.release(w.pslot);
      w.pslot = -1;
    }
  }
}

std::shared_ptr<IoBatch> NvmeParamTier::write(int u, char* data, const PinnedPool* pool,
                                              int64_t step) {
  const Unit& w = units_[size_t(u)];
  std::vector<Piece> ps;
  store_.pieces(w.slot[1 - w.cur], data, pool, true, ps);
  return space_.io().submit(std::move(ps), who() + "write of unit '" + ctx_.unit(u).layout.name +
                                               "' (parameters, slot " + std::to_string(1 - w.cur) +
                                               ") in step " + std::to_string(step));
}

// The optimizer state is in memory: the new shards are computed (on copies of the state) and
// written to the other slots first; only once every rank wrote them may the state change. A
// failed write leaves memory untouched. Costs a second pass of the update, on a combination
// that only saves 2 bytes per parameter of memory.
void NvmeParamTier::store_update(int64_t step,
                                 const std::function<void(int u, void* out)>& compute) {
  PipelineHooks h;
  h.read = [](int, int) { return std::vector<std::shared_ptr<IoBatch>>{}; };
  h.update = [&](int u, int slot) {
    zero_padding(ctx_.unit(u), pool_.data(slot), ctx_.pbytes);
    compute(u, pool_.data(slot));
  };
  h.write = [&](int u, int slot) {
    return std::vector<std::shared_ptr<IoBatch>>{write(u, pool_.data(slot), &pool_, step)};
  };
  const PipelineResult pr = run_pipeline(space_.io(), pool_, int(units_.size()), 0, h);
  if (std::optional<Error> failed =
          agree(*ctx_.comm, pr.error, "step " + std::to_string(step) + " (nvme swap)"))
    throw Error(failed->code(), std::string(failed->what()) + not_applied(step));
}

void NvmeParamTier::update(StateTier& state, const std::vector<cpu::UpdateHyper>& hyper,
                           int64_t step) {
  if (!state_in_memory_) return state.update(hyper, step, *this);  // writes beside its records
  store_update(step, [&](int u, void* out) { state.preview(hyper, step, u, out); });
  state.update(hyper, step, *this);  // writes no shard: target() is null
  commit_writes();
}

void NvmeParamTier::commit_writes() {
  for (Unit& w : units_) w.cur = 1 - w.cur;
}

std::vector<float> NvmeParamTier::read(int u) const {
  const Unit& w = units_[size_t(u)];
  const int64_t n = ctx_.shard(u);
  Buffer tmp(ctx_.ledger, Tier::host, MemKind::buffer, "swap_readback",
             size_t(round_up(n * int64_t(ctx_.pbytes), 4096)));
  std::vector<Piece> ps;
  store_.pieces(w.slot[w.cur], tmp.as<char>(), nullptr, false, ps);
  auto b =
      space_.io().submit(std::move(ps), who() + "read of unit '" + ctx_.unit(u).layout.name +
                                            "' (parameters, slot " + std::to_string(w.cur) + ")");
  space_.io().wait(*b);
  std::vector<float> out(static_cast<size_t>(n));
  cpu::convert(arena_.isa(), tmp.data(), ctx_.pdt, out.data(), DType::f32, n);
  return out;
}

// A restored shard goes to the other slot, which is then committed: a failure leaves the unit
// as it was.
void NvmeParamTier::restore(int u, const float* master) {
  Unit& w = units_[size_t(u)];
  const int64_t n = ctx_.shard(u);
  Buffer tmp(ctx_.ledger, Tier::host, MemKind::buffer, "swap_readback",
             size_t(round_up(n * int64_t(ctx_.pbytes), 4096)));
  cpu::convert(arena_.isa(), master, DType::f32, tmp.data(), ctx_.pdt, n);
  std::vector<Piece> ps;
  store_.pieces(w.slot[1 - w.cur], tmp.as<char>(), nullptr, true, ps);
  auto wr = space_.io().submit(std::move(ps), who() + "write of unit '" + ctx_.unit(u).layout.name +
                                                  "' (restored parameters)");
  space_.io().wait(*wr);
  w.cur = 1 - w.cur;
}

std::vector<std::pair<void*, size_t>> NvmeParamTier::dma_regions() const {
  std::vector<std::pair<void*, size_t>> out;
  for (int i = 0; i < pool_.count(); ++i) out.push_back({pool_.data(i), pool_.bytes()});
  return out;
}

}  // namespace zeroshard::offload
