#pragma once
// What a tier is (docs/DESIGN.md "tiers"): the interfaces the engine's stage logic talks to, so
// that it never asks where a unit's state lives.
//
// - StateTier holds the optimizer side of every unit: the f32 master weights, the optimizer
//   moments, and the reduced gradient shard on its way to them. Implementations: memory reached
//   through a Compute backend (device or host, src/tiers/memory_state_tier.cpp), the same fed
//   from a GPU through pinned staging (src/tiers/staged_state_tier.cpp), and swap files
//   (src/tiers/nvme_state_tier.cpp).
// - ParamTier holds the low-precision parameters the trainer computes with: whole in stages
//   0–2, this rank's shard in stage 3 (src/tiers/memory_param_tier.cpp,
//   src/tiers/nvme_param_tier.cpp).
// - ParamSink is how a StateTier's update hands each unit's new low-precision shard to where the
//   parameters live. Every ParamTier is one, and it alone decides the route a new shard takes
//   (ParamTier::update): into its memory as the update computes it, written to disk beside the
//   state's own records, or stored before the state may change.
//
// A new tier (compressed, remote) is a new implementation of one of these; the stage logic in
// src/engine_*.cpp does not change. Units are numbered as registered; every call runs on the
// trainer's thread. Positions are elements; "extent" is the state's range: the whole padded unit
// in stage 0, this rank's shard otherwise.

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "base/layout.hpp"
#include "kernels/cpu/cpu_kernels.hpp"
#include "zeroshard/config.hpp"
#include "zeroshard/error.hpp"
#include "zeroshard/memory.hpp"

namespace zeroshard {

namespace offload {
class IoBatch;
class PinnedPool;
}  // namespace offload

class Buffer;
class Communicator;
class Ledger;

/// How a state tier takes StateTier::speculate() (Config::speculative_step): not at all; into
/// memory of its own for the new low-precision values; or into memory its caller brings
/// (StagedStateTier's upload buffers).
enum class Speculative { off, own_out, caller_out };

/// What every tier is told about the engine it serves. The pointers outlive the tier.
struct TierContext {
  const Config* cfg = nullptr;
  const std::vector<UnitShape>* units = nullptr;
  int rank = 0;            ///< in the world (what messages name)
  int shard_rank = 0;      ///< which shard of each unit this rank holds (Config::shard_group_size)
  DType pdt = DType::f32;  ///< parameter and gradient dtype
  size_t pbytes = 4;
  int num_states = 0;  ///< optimizer moments per element: 0, 1 or 2
  Ledger* ledger = nullptr;
  /// A plan (src/planner/plan_memory.cpp): the ledger counts buffers without memory behind
  /// them, and swap files are created sparse (no space reserved) and never written.
  bool plan_only = false;
  /// The engine's communicator (for failures all ranks must share, see base/agree.hpp).
  Communicator* comm = nullptr;
  /// A ledger-counted buffer of `bytes` on `tier`: device memory of the engine's device, or
  /// host memory (page-locked when `pin`, through the GPU's allocator when there is one).
  std::function<Buffer(Tier, MemKind, const char* name, size_t bytes, bool pin)> buffer;
  /// Waits for unit u's reduction in flight (if any) and hands it to StateTier::grad_reduced():
  /// for a tier that must reuse the memory it lands in.
  std::function<void(int u)> finish_reduction;
  /// Muon (src/engine_muon.cpp): unit u's direction (f32, indexed like a's extent) made from the
  /// gradient and momentum `a` points at, for a's update to read as UpdateArgs::dir; null where
  /// u holds no Muon matrix. Collective over the shard group: a tier calls it for every unit, in
  /// unit order, just before that unit's update (and preview), and runs that update before the
  /// next call (the memory is reused). A tier whose update stopped on a failure of this rank
  /// still calls it for the units left, with a null a.grad (contributing nothing), so that the
  /// other ranks' exchanges complete and the failure is agreed on. Unset unless a group is muon.
  std::function<const float*(int u, const cpu::UpdateArgs& a)> direction;

  const UnitShape& unit(int u) const { return (*units)[size_t(u)]; }
  int64_t shard(int u) const { return unit(u).layout.shard_numel; }
  /// Elements of the f32 state of unit u (the whole padded unit in stage 0, else the shard).
  int64_t extent(int u) const {
    return cfg->stage == 0 ? unit(u).layout.padded_numel : unit(u).layout.shard_numel;
  }
  /// Index in unit u of the extent's element 0: 0 in stage 0, else this rank's shard start.
  int64_t extent_start(int u) const { return cfg->stage == 0 ? 0 : shard_rank * shard(u); }
  /// The master weights' dtype: f32, or bf16 (Config::bf16_master).
  DType master_dtype() const { return cfg->bf16_master ? DType::bf16 : DType::f32; }
  /// The group runs of the state's extent.
  const std::vector<GroupRun>& runs(int u) const {
    return cfg->stage == 0 ? unit(u).whole_runs : unit(u).shard_runs;
  }
  int accumulation() const { return cfg->gradient_accumulation_steps; }
  /// "rank 1, unit 'layer3'"
  std::string where(int u) const {
    return "rank " + std::to_string(rank) + ", unit '" + unit(u).layout.name + "'";
  }
};

/// Where an update's low-precision shards go (implemented by the engine).
class ParamSink {
 public:
  virtual ~ParamSink() = default;
  /// Memory (host memory for a CPU update) the update writes unit u's new low-precision
  /// values to, indexed like the state's extent; null: none wanted (f32 parameters that are the
  /// master weights themselves).
  virtual void* target(int u) = 0;
  /// The values at target(u) are final (called once per unit, in unit order).
  virtual void done(int u) = 0;
  /// Whether done() starts work (an upload to a GPU) that should overlap the next unit's
  /// update: then the update runs unit by unit instead of all units at once.
  virtual bool per_unit() const { return false; }
  /// Rebuilds unit u's low-precision values from `master` (extent elements of f32, host memory),
  /// off the step path: a restore after a failed step, or after write_shard().
  virtual void restore(int u, const float* master) = 0;
  /// Takes `values` (unit u's new low-precision values, indexed and sized like target(u)) as
  /// the memory target(u) points at from now on, instead of a copy, and gives its old memory
  /// back in `values`: true where the sink keeps that memory in a buffer of its own that no one
  /// else holds (stage 3's shards in a CPU engine's memory); false: the caller copies.
  virtual bool adopt(int /*u*/, Buffer& /*values*/) { return false; }

  /// The route for shards kept on disk, taken by a state tier whose own records are on disk:
  /// the update computes unit u's new shard into `data` (in a slot of the caller's `pool`) and
  /// write() starts writing it to where the next step's shard goes. The step's shards become
  /// current at commit_writes(), which the caller calls once every rank wrote every unit.
  virtual bool takes_writes() const { return false; }
  virtual std::shared_ptr<offload::IoBatch> write(int /*u*/, char* /*data*/,
                                                  const offload::PinnedPool* /*pool*/,
                                                  int64_t /*step*/) {
    return nullptr;
  }
  virtual void commit_writes() {}
};

/// One state's shard of one unit as a tier stores it in host memory: shard_numel values in
/// `format`, and for q8 the f32 absmax of each of its blocks. data null: not in host memory.
struct StoredShard {
  StateFormat format = StateFormat::f32;
  void* data = nullptr;
  float* absmax = nullptr;
};

/// A state frozen as it was when StateTier::snapshot() took it, which one other thread reads
/// while training goes on.
class StateSnapshot {
 public:
  virtual ~StateSnapshot() = default;
  /// This rank's shard of one state of unit u (f32, shard_numel values), valid until a view of
  /// another unit. Units are viewed in increasing order: viewing unit u gives every unit before
  /// it back to the tier.
  virtual const float* view(int u, StateKind kind) = 0;
};

/// The optimizer side of every unit. See the file comment.
class StateTier {
 public:
  virtual ~StateTier() = default;

  /// finalize(): the master weights of unit u from `whole` (the padded unit in f32; null:
  /// zeros), optimizer state zero. Units come in order; finish_load() follows the last one.
  virtual void load_initial(int u, const float* whole) = 0;
  virtual void finish_load() {}

  /// grads_ready(): where unit u's reduce-scatter writes its reduced shard (pdt elements).
  virtual void* grad_target(int u) = 0;
  /// The reduce-scatter into grad_target(u) finished (a collective already waited for).
  /// `micro` counts the micro-steps of u reduced before this one. The tier folds the shard into
  /// its accumulation and, once final, may take its share of the norm. `whole` is stage 0's
  /// all-reduced whole gradient (the trainer's buffer), else null.
  virtual void grad_reduced(int u, int micro, const void* whole) = 0;
  /// The reduce-scatter into grad_target(u) failed to start: what grad_target() took for it
  /// may be given back (the trainer may go on with other units, or retry this one).
  virtual void grad_abandoned(int) {}
  /// step(): every gradient is where update() reads it; returns a failure to keep one (the
  /// engine agrees on it across ranks and applies no update).
  virtual std::optional<Error> settle_grads() { return std::nullopt; }
  /// Σ g² over this rank's gradients of every unit, summed in unit order; +inf when any element
  /// is inf or NaN.
  virtual double sum_squares() = 0;
  /// Drops this step's gradients (zero_grad(), a skipped or failed step).
  virtual void forget_grads() {}

  /// The update of every unit with hyper[group] per run, each unit's new low-precision values
  /// written to sink.target(u). All or nothing across ranks: on failure it throws, every rank
  /// keeps the state of the last step, and the parameters are restored through the sink.
  virtual void update(const std::vector<cpu::UpdateHyper>& hyper, int64_t step,
                      ParamSink& sink) = 0;
  /// The speculative step (Config::speculative_step, docs/tiers.md): whether this tier takes
  /// speculate().
  virtual bool speculates() const { return false; }
  /// Unit u's gradient is final before step(): its update with `hyper` as step `step` may start
  /// now, beside backward, on a thread of the tier's own, into a second copy of the unit's state
  /// (what read(), stored() and a save see stays the last step's). The next update() keeps it
  /// for every unit whose update would read exactly what it read (the same hyper, step, group
  /// runs and gradient), and computes the others as usual: so the result is bitwise the step's
  /// whatever the step finds (an overflow, a clip, a parameter held, a new learning rate).
  /// forget_grads(), write() and commit() drop it. `out`: where the new low-precision values
  /// go, memory no one reads before update() and which is then its sink.target(u) (a GPU's
  /// upload buffer); null: the tier's own, copied to the target by update().
  virtual void speculate(int /*u*/, const std::vector<cpu::UpdateHyper>& /*hyper*/,
                         int64_t /*step*/, void* /*out*/) {}
  /// Units of the last update() whose speculation it kept, and those it had to drop.
  struct SpeculationCount {
    int kept = 0, dropped = 0;
  };
  virtual SpeculationCount speculated() const { return {}; }
  /// Unit u's new low-precision values written to `out` (host memory) without changing any
  /// state: the update() that follows computes bitwise the same values. For parameter tiers
  /// that must hold the new parameters before the state may change (ParamTier::previews()).
  virtual void preview(const std::vector<cpu::UpdateHyper>& hyper, int64_t step, int u,
                       void* out) = 0;

  /// This rank's shard of unit u's reduced gradient (f32, shard_numel values) once the step's
  /// micro-steps are complete and before its update: the sum over ranks and micro-steps, still
  /// loss-scaled (the caller divides). Zeros where no gradient was handed over.
  virtual std::vector<float> read_grad(int u) = 0;
  /// This rank's shard of one state of unit u (f32, shard_numel values); throws
  /// Error(invalid_argument) for a moment the optimizer does not keep.
  virtual std::vector<float> read(int u, StateKind kind) const = 0;
  /// The same shard as the tier stores it, where the CPU reaches it in place (host memory,
  /// valid until the state next changes), else {}: a checkpoint streams from it with neither a
  /// copy nor a conversion, and a load of a checkpoint in the same format writes it in place
  /// instead of write() (then calls commit()).
  virtual StoredShard stored(int /*u*/, StateKind /*kind*/) { return {}; }
  /// The state as it is now, kept by the tier where it already lies instead of copied (the
  /// nvme tier: the record slots of the last committed step, which the next steps write
  /// around until the snapshot is done with them), or nullptr where the tier cannot: then a
  /// caller copies it. At most one at a time.
  virtual std::unique_ptr<StateSnapshot> snapshot() { return nullptr; }
  /// Replaces this rank's shard of one state of unit u (restore). Stage 0's whole state is
  /// completed by commit().
  virtual void write(int u, StateKind kind, const std::vector<float>& shard) = 0;
  /// After write()s: makes the restored state whole where it is kept whole (collective), then
  /// rebuilds every unit's low-precision values from the master through the sink.
  virtual void commit(Communicator& comm, ParamSink& sink) = 0;

  /// Host memory the tier receives reduced gradients in, for a GPU to copy into by DMA.
  virtual std::vector<std::pair<void*, size_t>> dma_regions() const { return {}; }
};

/// The low-precision parameters, and the sink their updates go through. See the file comment.
class ParamTier : public ParamSink {
 public:
  /// finalize(): unit u's parameters rounded from `whole` (the padded unit in f32), or zeros.
  virtual void load_initial(int u, const float* whole) = 0;
  virtual void finish_load() {}

  /// The parameters the trainer reads: the whole unit (stages 0–2), in the engine's device
  /// memory. Null in stage 3.
  virtual void* whole(int u) = 0;
  /// Where this rank's updated shard goes, in memory the engine's device reaches: its block of
  /// the whole parameters (stages 1–2), the whole unit (stage 0), the shard (stage 3). Null
  /// when the tier keeps it elsewhere (on disk).
  virtual void* own(int u) = 0;

  /// Stage 3 gather(): this rank's shard of unit u to all-gather from. May read it (collective:
  /// every rank fails together). Returns null when no staging memory is free: the engine then
  /// ends a prefetched gather (calling gathered()) and asks again.
  virtual const void* gather_source(int u) { return own(u); }
  /// The all-gather of unit u finished: the source may be reused.
  virtual void gathered(int) {}
  /// The engine gave unit u's gather buffer back (release(), or a dropped prefetch).
  virtual void released(int) {}
  /// Stage 3: the trainer gathers order[pos], order[pos + 1], … next: read ahead. No collective.
  virtual void read_ahead(const std::vector<int>& /*order*/, size_t /*pos*/) {}
  /// Before an update changes the parameters: forget what was read ahead.
  virtual void drop_reads() {}

  /// The step's update of `state`, each unit's new shard taken the way this tier keeps it; all
  /// or nothing across ranks, as StateTier::update(). By default the update writes into
  /// target(u) as it goes.
  virtual void update(StateTier& state, const std::vector<cpu::UpdateHyper>& hyper, int64_t step) {
    state.update(hyper, step, *this);
  }
  /// Whether update() asks the state tier for StateTier::preview() (it stores the new shards
  /// before the state may change): the state tier then keeps the scratch memory a preview needs.
  virtual bool previews() const { return false; }
  /// An f32 model whose master weights live in the same memory as its parameters: unit u's
  /// parameters become its master weights (their memory returned, null in a plan; the update
  /// then writes no separate copy), or nullopt where this tier cannot share them.
  virtual std::optional<float*> share_as_master(int) { return std::nullopt; }

  /// ParamSink, for a tier in memory: the update writes each shard into own(u), unless the
  /// shard is the master weights themselves.
  void* target(int u) override { return own(u); }
  void done(int) override {}

  /// This rank's shard of unit u in f32.
  virtual std::vector<float> read(int u) const = 0;
  /// Host memory a GPU copies shards out of, for the engine to page-lock for DMA (StateTier's
  /// likewise).
  virtual std::vector<std::pair<void*, size_t>> dma_regions() const { return {}; }
};

}  // namespace zeroshard
