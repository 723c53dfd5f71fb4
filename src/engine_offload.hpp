#pragma once
// The engine's NVMe tier state (engine_offload.cpp): swap files, pinned staging pools and the
// I/O queue of one engine, and each unit's place in them.
//
// What lives where with offload_optimizer = nvme:
// - fp32 master weights and optimizer state: on disk, one *record* per unit (master | state0 |
//   state1, each section 4096-aligned), in two slots. A step reads slot cur, writes slot 1−cur,
//   and flips every unit's cur only after every write of the step (on every rank) succeeded:
//   a failed step leaves the last committed step intact on disk (2× disk space for this).
// - gradient shards follow the optimizer to nvme, through a write-back cache: the reduce-scatter
//   lands in one of grad_buffers + 1 pinned slots; when the slots run out the oldest unit's
//   gradient (or its f32 accumulation) is written to its grad extent and read back at step()
//   (or, under accumulation, at its next micro-step). The last units of the backward pass stay
//   in memory and are never written. Keeping every gradient in pinned memory instead would cap
//   the model at memory / 2 bytes per parameter, defeating the tier. The norm's sum of squares
//   is taken when a unit's gradient is final, in the same chunks as in memory (bitwise parity).
// With offload_param = nvme (stage 3): each unit's low-precision shard has two slots in its own
// file; gather() reads it into a pinned staging slot (ahead, in the recorded gather order) and
// all-gathers from there; step() writes the new shard to the other slot, committed with the rest.

#include <deque>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "src/base/ledger.hpp"
#include "offload/io_queue.hpp"
#include "offload/pinned_pool.hpp"
#include "offload/run_dir.hpp"
#include "offload/swap_store.hpp"

namespace zeroshard {

/// Byte layout of one unit in a swap pipeline slot. The record part matches the record extent.
struct RecordLayout {
  size_t sec = 0;       // one f32 section: shard_numel × 4, rounded up to 4096
  size_t record = 0;    // master + states
  size_t grad_off = 0;  // gradient shard (pdt, or f32 under accumulation)
  size_t grad_sec = 0;
  size_t lowp_off = 0;  // low-precision parameter shard (stage 3 with offload_param nvme)
  size_t lowp_sec = 0;
  size_t total = 0;
};

struct NvmeUnit {
  int rec[2] = {-1, -1};  // optimizer store: record extents (two slots)
  int grad = -1;          // optimizer store: gradient extent
  int cur = 0;            // committed record slot
  int par[2] = {-1, -1};  // parameter store: shard extents (two slots)
  int pcur = 0;           // committed parameter slot
  // Gradient cache (offload_optimizer nvme).
  int gslot = -1;             // grad_pool slot holding this unit's gradient, or -1
  bool grad_on_disk = false;  // the grad extent holds the gradient (or its partial sum)
  std::shared_ptr<offload::IoBatch> grad_write;  // eviction in flight from wslot
  int wslot = -1;
  double sumsq = 0;  // Σ g² of the final gradient shard, for the norm
  // Parameter staging (offload_param nvme).
  int pslot = -1;  // param_pool slot with this unit's shard (read or being read)
  std::shared_ptr<offload::IoBatch> pread;
};

/// Swap-file bytes charged to the ledger's nvme tier for the state's lifetime.
class DiskCharge {
 public:
  DiskCharge(Ledger* l, MemKind k, std::string name, int64_t bytes)
      : l_(l), k_(k), name_(std::move(name)), n_(bytes) {
    l_->add(Tier::nvme, k_, name_, n_);
  }
  ~DiskCharge() { l_->sub(Tier::nvme, k_, name_, n_); }
  DiskCharge(const DiskCharge&) = delete;
  DiskCharge& operator=(const DiskCharge&) = delete;

 private:
  Ledger* l_;
  MemKind k_;
  std::string name_;
  int64_t n_;
};

struct NvmeState {
  bool opt = false, par = false;  // which tiers are on nvme
  std::vector<offload::RunDir> dirs;
  offload::SwapStore opt_store, par_store;
  offload::PinnedPool swap_pool;   // optimizer pipeline slots
  offload::PinnedPool grad_pool;   // gradient cache slots: [reduce-scatter output | f32 sum]
  offload::PinnedPool param_pool;  // parameter shards (gather staging, step write-back)
  Buffer scratch;                  // per-thread state copies (param nvme, optimizer in memory)
  size_t grad_acc_off = 0;         // f32 sum section of a grad_pool slot
  int read_ahead = 1;
  bool preallocate = true;
  std::vector<NvmeUnit> units;
  std::deque<int> grad_fifo;      // units holding grad slots, oldest first
  std::optional<Error> deferred;  // a failed gradient write or read, reported at step()
  std::deque<int> evicting;       // units whose gradient is being written, oldest first
  std::deque<std::pair<std::shared_ptr<offload::IoBatch>, std::pair<offload::PinnedPool*, int>>>
      init_writes;
  std::vector<std::unique_ptr<DiskCharge>> charges;
  // On a GPU: the gradient cache registered with CUDA, so shards come down by DMA. After the
  // pools, so the registrations end before the memory goes.
  std::vector<std::shared_ptr<void>> dma;
  std::unique_ptr<offload::IoQueue> io;  // declared last: stopped before the memory goes
};

}  // namespace zeroshard
