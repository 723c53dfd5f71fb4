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
// - The speculative step (Config::speculative_step): as each unit's gradient is final during
//   backward, a thread of the tier's own reads the unit's committed record, updates it and writes
//   it to the other slot, the one the step would write. update() keeps the units whose update
//   would read exactly what that one read (their record is already written) and runs the
//   pipeline over the others, which write the same slot again. The other slot is the rollback:
//   no disk space is added, only the new low-precision values of every unit in memory.

#include <atomic>
#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "base/ledger.hpp"
#include "kernels/cpu/arena.hpp"
#include "kernels/cpu/update_tasks.hpp"
#include "offload/pinned_pool.hpp"
#include "offload/swap_space.hpp"
#include "offload/swap_store.hpp"
#include "src/tiers/initial_writes.hpp"
#include "src/tiers/speculation.hpp"
#include "src/tiers/tier.hpp"

namespace zeroshard::offload {

class NvmeStateTier final : public StateTier {
 public:
  /// `writes_params`: the parameter tier takes each unit's new shard as a write beside the
  /// state's records (ParamSink::takes_writes(), the parameters on nvme too), so each record
  /// keeps room for it. Registers its file and pools with `space`. `speculative`: whether to
  /// take speculate(), and where its new low-precision values go (never with writes_params).
  NvmeStateTier(const TierContext& ctx, cpu::Arena& arena, SwapSpace& space, bool writes_params,
                Speculative speculative = Speculative::off);
  /// Waits for the speculation in progress and its writes (their memory goes with the tier).
  ~NvmeStateTier() override;

  void load_initial(int u, const float* whole) override;
  void finish_load() override;
  void* grad_target(int u) override;
  void grad_reduced(int u, int micro, const void* whole) override;
  std::optional<Error> settle_grads() override;
  double sum_squares() override;
  void forget_grads() override;
  void update(const std::vector<cpu::UpdateHyper>& hyper, int64_t step, ParamSink& sink) override;
  bool speculates() const override { return !spec_.empty(); }
  void speculate(int u, const std::vector<cpu::UpdateHyper>& hyper, int64_t step,
                 void* out) override;
  SpeculationCount speculated() const override { return counted_; }
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
  /// Unit u's update as step `step` on the record in `base` (a swap_pool_ slot), reading the
  /// gradient at `grad` (grad_dtype()) and writing its new low-precision values to `out`.
  cpu::UnitUpdate unit_update(int u, char* base, const void* grad, void* out, int64_t step) const;
  DType grad_dtype() const { return ctx_.accumulation() > 1 ? DType::f32 : ctx_.pdt; }
  /// The gradient in unit u's cache slot (w.gslot >= 0).
  char* cached_grad(int u) const;
  std::string who() const;            // "rank 1: nvme swap "
  void reap(bool block);              // evictions that finished give their slots back
  bool evict(int keep);               // writes the oldest cached gradient other than `keep`
  void read_back(int u, float* acc);  // an evicted partial sum comes back
  void settle_evictions();
  void forget();  // forget_grads() but the speculations (update() settled them)
  void restore_params(int updated, ParamSink& sink, std::string& errors);

  // ---- the speculative step ----
  /// Unit u's speculation: none; posted, not started; running (it reads the gradient's cache
  /// slot); done with the gradient (computed and its record written or being written, or failed).
  enum SpecState : int { kNone, kQueued, kRunning, kDone };
  struct Speculation {
    Buffer own_out;
    void* out = nullptr;         // the new low-precision values: own_out, or the caller's
    const char* grad = nullptr;  // its gradient, in the unit's cache slot
    std::atomic<int> state{kNone};
    bool written = false;  // its record reached the other slot (after drain_spec_writes())
    std::vector<cpu::UpdateHyper> hyper;
    int64_t step = 0;
    std::vector<GroupRun> runs;
  };
  struct SpecWrite {  // a speculation's record on its way to disk, from a swap_pool_ slot
    int unit, slot;
    std::shared_ptr<IoBatch> io;
  };
  /// On the speculation thread: unit u's record read, updated and its write started.
  void run_speculation(int u);
  /// update(): unit u's kept speculation's new values to sink.target(u), then sink.done(u).
  void keep_speculation(int u, ParamSink& sink);
  /// Settles the oldest speculation write (the thread's, or the trainer's after a settle()).
  void reap_spec_write();
  /// The trainer's thread, after thread_.settle(): every speculation write settled.
  void drain_spec_writes();
  bool matches(int u, const std::vector<cpu::UpdateHyper>& hyper, int64_t step) const;
  /// Whether unit u's gradient slot may be evicted: its speculation does not read it (one not
  /// started is dropped). Trainer's thread.
  bool evictable(int u);
  /// Blocks until unit u's speculation, if running, has read its gradient. Trainer's thread.
  void wait_read(int u);
  /// Drops every speculation (or unit u's): cancels what has not started, waits for the rest.
  void drop_speculation(int only = -1);

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
  std::vector<Speculation> spec_;  // empty: the tier does not speculate
  size_t quiesce_key_ = 0;         // SwapSpace::before_stop()'s
  std::deque<SpecWrite> spec_writes_;
  std::mutex spec_mu_;  // with spec_cv_: a running speculation finished reading its gradient
  std::condition_variable spec_cv_;
  SpeculationCount counted_;
  int dropped_early_ = 0;     // dropped by a write, forget_grads() or an eviction meanwhile
  SpeculationThread thread_;  // last: joined before the memory it uses goes
};

}  // namespace zeroshard::offload
