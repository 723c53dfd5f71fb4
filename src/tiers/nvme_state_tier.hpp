#pragma once
// The optimizer state on nvme (offload_optimizer = nvme).
//
// - master weights (f32, or bf16 with Config::bf16_master) and optimizer state: on disk, one
//   *record* per unit (master | state0 | state1, each section 4096-aligned; the moments in
//   Config::optimizer_state's format, so compact moments shrink the record and every step's
//   bytes), in two slots. A step reads slot cur, writes slot 1−cur, and flips every unit's cur
//   only after every write of the step (on every rank) succeeded: a failed step leaves the last
//   committed step intact on disk (2× disk space for this).
// - gradient shards follow the optimizer to nvme, through a write-back cache: the reduce-scatter
//   lands in one of grad_buffers + 1 pinned slots; when the slots run out the oldest unit's
//   gradient (or its f32 accumulation) is written to its grad extent and read back at step()
//   (or, under accumulation, at its next micro-step). The last units of the backward pass stay
//   in memory and are never written. Keeping every gradient in pinned memory instead would cap
//   the model at memory / 2 bytes per parameter, defeating the tier. The norm's sum of squares
//   is taken when a unit's gradient is final, in the same chunks as in memory (bitwise parity).
// - With the parameters on nvme too (stage 3), the update writes each unit's new
//   low-precision shard into its record's slot, and it is written with the record.
// - An asynchronous checkpoint reads the committed slots while the next steps run (snapshot()).

#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "base/ledger.hpp"
#include "kernels/cpu/arena.hpp"
#include "offload/pinned_pool.hpp"
#include "offload/swap_space.hpp"
#include "offload/swap_store.hpp"
#include "src/tiers/initial_writes.hpp"
#include "src/tiers/tier.hpp"

namespace zeroshard::offload {

class NvmeStateTier final : public StateTier {
 public:
  /// `writes_params`: the parameter tier takes each unit's new shard as a write beside the
  /// state's records (ParamSink::takes_writes(), the parameters on nvme too), so each record
  /// keeps room for it. Registers its file and pools with `space`.
  NvmeStateTier(const TierContext& ctx, cpu::Arena& arena, SwapSpace& space, bool writes_params);

  void load_initial(int u, const float* whole) override;
  void finish_load() override;
  void* grad_target(int u) override;
  void grad_reduced(int u, int micro, const void* whole) override;
  std::optional<Error> settle_grads() override;
  double sum_squares() override;
  void forget_grads() override;
  void update(const std::vector<cpu::UpdateHyper>& hyper, int64_t step, ParamSink& sink) override;
  void preview(const std::vector<cpu::UpdateHyper>& hyper, int64_t step, int u, void* out) override;
  std::vector<float> read(int u, StateKind kind) const override;
  std::vector<float> read_grad(int u) override;
  void write(int u, StateKind kind, const std::vector<float>& shard) override;
  void commit(Communicator& comm, ParamSink& sink) override;
  std::vector<std::pair<void*, size_t>> dma_regions() const override;
  /// The record slots of the last committed step, read by the snapshot's thread straight from
  /// the swap files into one record's buffer. A step writes the other slots, so only the second
  /// step after it would overwrite a pinned record: it waits for the snapshot to have read that
  /// unit.
  std::unique_ptr<StateSnapshot> snapshot() override;

 private:
  class Snapshot;
  // The record slot of each unit that a snapshot has not read yet (-1: none), shared with the
  // snapshot's thread.
  struct Pins {
    std::mutex mu;
    std::condition_variable cv;
    std::vector<int> slot;
  };
  void wait_unpinned(int u, int slot);  // before record slot `slot` of unit u is written
  /// Byte layout of one unit in a swap pipeline slot; the record part matches the record extent.
  /// Each moment's section holds its elements in Config::optimizer_state's format and, for q8,
  /// its absmax array after them.
  struct Record {
    size_t sec = 0;         // the master: shard_numel × its dtype's size, rounded up to 4096
    size_t absmax_off = 0;  // q8: the moment's absmax array, from its section's start
    size_t mbytes = 0;      // one moment's bytes (q8: codes and absmax)
    size_t msec = 0;        // mbytes rounded up to 4096
    size_t record = 0;      // master + moments
    size_t grad_off = 0;    // gradient shard (pdt, or f32 under accumulation)
    size_t grad_sec = 0;
    size_t lowp_off = 0;  // low-precision parameter shard (parameters on nvme)
    size_t lowp_sec = 0;
    size_t total = 0;
    /// Where `kind` starts in the record (master, state0, state1).
    size_t offset(StateKind kind) const {
      return kind == StateKind::master ? 0 : kind == StateKind::state0 ? sec : sec + msec;
    }
  };
  /// One moment of a record held in memory, widened to f32 (`out`, shard_numel values).
  void widen(int u, const char* record, StateKind kind, float* out) const;
  void check_kind(const char* call, int u, StateKind kind) const;
  struct Unit {
    int rec[2] = {-1, -1};                // record extents (two slots)
    int grad = -1;                        // gradient extent
    int cur = 0;                          // committed record slot
    int gslot = -1;                       // grad_cache slot holding this unit's gradient, or -1
    bool grad_on_disk = false;            // the grad extent holds the gradient (or its partial sum)
    std::shared_ptr<IoBatch> grad_write;  // eviction in flight from wslot
    int wslot = -1;
    double sumsq = 0;  // Σ g² of the final gradient shard, for the norm
  };
  Record record(int u) const;
  std::string who() const;            // "rank 1: nvme swap "
  void reap(bool block);              // evictions that finished give their slots back
  bool evict(int keep);               // writes the oldest cached gradient other than `keep`
  void read_back(int u, float* acc);  // an evicted partial sum comes back
  void settle_evictions();
  void restore_params(int updated, ParamSink& sink, std::string& errors);

  TierContext ctx_;
  cpu::Arena& arena_;
  SwapSpace& space_;
  bool writes_params_;
  mutable SwapStore store_;  // mutable: reads in const methods take its pieces too
  PinnedPool swap_pool_;     // optimizer pipeline slots
  PinnedPool grad_cache_;    // gradient cache slots: [reduce-scatter output | f32 sum]
  size_t grad_acc_off_ = 0;  // f32 sum section of a grad_cache_ slot
  int read_ahead_ = 1;
  std::vector<Unit> units_;
  std::deque<int> grad_fifo_;              // units holding cache slots, oldest first
  std::deque<int> evicting_;               // units whose gradient is being written, oldest first
  std::optional<Error> deferred_;          // a failed gradient write or read, reported at step()
  InitialWrites init_writes_{swap_pool_};  // finalize()'s writes
  std::vector<std::unique_ptr<DiskCharge>> charges_;
  std::shared_ptr<Pins> pins_ = std::make_shared<Pins>();
};

}  // namespace zeroshard::offload
