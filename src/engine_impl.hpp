#pragma once
// The engine's private state: the stage logic's per-unit progress and the tiers it talks to.
// The files that implement it, each one part of the flow of docs/DESIGN.md:
//   engine.cpp              construction, registration, accessors
//   engine_setup.cpp        finalize(): the tiers, initial values
//   engine_agreement.cpp    what every rank must agree on: the model, the collectives
//   engine_gather.cpp       parameters: views, stage-3 gather/release with prefetch
//   engine_grads.cpp        gradients: buffers, reduce-scatter, hand-over to the state tier
//   engine_step.cpp         step(): norm and flags, update, gather of the new parameters
//   engine_state.cpp        state access for checkpoints (read/write/commit shards)
//   engine_muon.cpp         Muon: each matrix's direction, orthogonalised by one rank
// The stage logic never asks which tier holds a unit's state: src/tiers/tier.hpp.

#include <algorithm>
#include <atomic>
#include <deque>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "base/gate.hpp"
#include "base/layout.hpp"
#include "base/ledger.hpp"
#include "src/muon_exchange.hpp"
#include "src/precision/loss_scaler.hpp"
#include "src/resources.hpp"
#include "src/tiers/tier.hpp"
#include "zeroshard/engine.hpp"
#include "zeroshard/error.hpp"

namespace zeroshard {

/// One unit's progress through a step, as the stage logic sees it.
struct Unit {
  std::vector<Param> init_params;  // kept only until finalize() reads the initial values
  // Stages 0–1: the trainer's whole gradient (stages 2–3 write it into a grad_staging buffer).
  Buffer grad_buf;
  std::shared_ptr<Work> reduction;  // reduce-scatter in flight, then its all-reduce across groups
  bool crossed = false;             // `reduction` is the all-reduce across groups
  void* reduced = nullptr;          // where it writes: the state tier's grad_target()
  bool grads_out = false;           // grads() handed out, grads_ready() not yet called
  bool queued = false;              // grads_ready() called, reduction waits for its turn
  int grad_slot = -1;               // stages 2–3: grad_staging buffer in use
  int micro_done = 0;               // micro-steps reduced since the last step
  // Per parameter: a gradient in some micro-step since the last step, on this rank (a trainer
  // passes none with a null view to grads_ready()). At step(): held = none on any rank.
  std::vector<uint8_t> grad_seen;
  std::vector<uint8_t> held;
  bool runs_hold = false;  // the shape's runs give the held parameters the hold group
  // Stage 3 gather state.
  int gather_slot = -1;
  std::shared_ptr<Work> gather_work;
  bool gathered = false;  // handed to the trainer (else, with a slot, it is a prefetch)
};

// The parts of the engine's state that one file writes and the others only read, each named by
// what it is. Fields a newcomer will not find here (the tiers, the units, the configuration) are
// set once by finalize() (engine_setup.cpp) and read by all.

/// Where this rank sits (Config::shard_group_size): it holds shard `shard_rank` of `shard_world`
/// within group `replica` of `replicas`. shard_comm joins the ranks of the group (the engine's
/// communicator itself when flat): reduce-scatters and all-gathers. replica_comm joins the ranks
/// holding the same shard in every group (null when flat): the all-reduce of the reduced
/// gradient shards. Written by the constructor (engine.cpp) and find_hosts() (engine_setup.cpp).
struct ShardTopology {
  std::shared_ptr<Communicator> shard_comm, replica_comm;
  int shard_rank = 0, shard_world = 1, replica = 0, replicas = 1;
  // Whether the next rank in each communicator's ring is on another host.
  bool shard_next_remote = false, replica_next_remote = false;
  std::vector<bool> shard_remote;  // per rank of shard_comm: on another host than this one
};

/// The reductions, in the one order every rank issues them whatever the trainer hands over
/// first, and how the micro-steps' gradients were closed for the step. Written by
/// engine_grads.cpp; step() and clip_grad_norm() (engine_step.cpp) close and reset it.
struct ReductionQueue {
  int next = 0;               // the unit whose turn it is, counting down in each micro-step
  std::deque<int> in_flight;  // units whose reduction was issued and not yet completed, in order
  // clip_grad_norm() ran: this step's {sum of squares, overflow}, and its clipping bound.
  std::optional<std::pair<double, bool>> closed;
  double clip_now = 0;
  std::optional<Error> lost_grad;  // a reduced gradient the state tier failed to take
};

/// The collectives issued since the last step: on every rank the same sequence whatever the
/// trainer's control flow, or step() finds out. (kind, unit) as kind * 2^24 + unit, their hash
/// (compared across ranks in step()'s one all-reduce), and the bytes this rank sent
/// (StepResult::comm_bytes). Written by record() (engine_agreement.cpp) and count_sent() as each
/// collective is issued; step() (engine_step.cpp) compares and resets it.
struct CollectiveLog {
  std::vector<int32_t> issued;
  uint64_t hash = 0;
  int64_t sent_bytes = 0, sent_inter = 0;  // all sent, and sent to another host
};

/// Stage 3's gathers: the order recorded during the first step and where the trainer is in it.
/// Written by gather() (engine_gather.cpp); step() (engine_step.cpp) ends the recording and
/// rewinds; ranks that disagree on the order (engine_agreement.cpp) drop it.
struct GatherSchedule {
  std::vector<int> order;
  bool recorded = false;
  size_t pos = 0;
};

/// The time of the current step interval (StepResult's breakdown): the collectives since the
/// last step, how long the trainer's thread was blocked on them, and when the interval began.
/// finalize() starts it, track() and wait_for() add to it on the step path, and step()
/// (engine_step.cpp) reads and restarts it.
struct StepClock {
  std::vector<std::shared_ptr<Work>> works;
  double exposed_s = 0;
  double interval_start = 0;
};

/// Config::speculative_step left to the engine (automatic): a step that speculated and kept
/// nothing (it clipped, overflowed, or changed a hyperparameter after backward) wasted that work,
/// and the next ones likely would too (a run that clips every step). The engine then speculates
/// no more for `pause` steps, doubling it (up to kMax) while that repeats; a step that keeps a
/// speculation resets it. Asked for (on), speculation runs every step.
struct SpeculationPause {
  static constexpr int kMax = 64;
  int left = 0;   // steps still to run without speculating
  int pause = 1;  // the next pause's length
  /// After a step: what its speculations came to (`speculated`: it posted any).
  void after_step(bool speculated, int kept) {
    if (left > 0) {
      --left;
    } else if (speculated && kept == 0) {
      left = pause;
      pause = std::min(2 * pause, kMax);
    } else if (kept > 0) {
      pause = 1;
    }
  }
};

/// Closed while a save's thread copies the state into its snapshot: nothing may change the
/// state meanwhile (Engine::Impl::before_state_change() waits for open()).
using CopyGate = Gate;

/// Muon (src/engine_muon.cpp): each unit's Muon matrices, which rank of the shard group
/// orthogonalises each (fixed at finalize(), balanced by the iteration's cost), and the rounds
/// of the unit's exchange as this rank takes part in them (src/muon_exchange.hpp). Its f32
/// buffers: this rank's extent of a unit (`mine`), the largest matrix it orthogonalises
/// (`exchange`, with more than one rank) and the iteration's scratch. `hyper` is the step's,
/// while update() runs.
struct MuonPlan {
  /// A round: the matrix this rank orthogonalises (an index into the unit's, or −1) and its
  /// pieces, in elements: of its extent (gather_send, scatter_recv) and of that matrix
  /// (gather_recv, scatter_send). Where every rank holds the unit whole, nothing is gathered.
  struct Round {
    int matrix = -1;
    Pieces gather_send, gather_recv, scatter_send, scatter_recv;
  };
  std::vector<std::vector<MuonMatrix>> units;  // muon_matrices()
  std::vector<std::vector<Round>> rounds;      // per unit
  // The state is in a stream device's memory (a GPU's): the direction is made there, by the
  // device's kernels, in device buffers; else on the host by the CPU's.
  bool on_device = false;
  Buffer mine, exchange;
  Buffer scratch;  // the iteration's, for the largest matrix this rank orthogonalises
  const std::vector<cpu::UpdateHyper>* hyper = nullptr;
  double ns_s = 0;  // time in the Newton-Schulz iteration since the last step() read it
};

/// save_async(): the snapshot, kept from one save to the next (a new buffer's page faults cost
/// more than the copy), the gate its copy holds closed, and the save under way
/// (src/checkpoint/save.cpp's PendingSave, which finish_save() ends; declared after the
/// snapshot its thread reads, so destroyed first). With Config::checkpoint_async, finalize()
/// makes the snapshot and `faulting` faults it in (declared after the snapshot too: stopped and
/// joined before the buffer goes; the first save's thread takes it over and joins it before
/// copying). `faulted`: the snapshot's pages are in, or being faulted in by a thread a copy
/// joins first. Written by src/checkpoint/save.cpp only.
struct AsyncSave {
  Buffer snapshot;
  bool faulted = false;
  std::jthread faulting;
  std::shared_ptr<CopyGate> copying;  // null when no copy is under way
  std::shared_ptr<void> pending;
};

struct Engine::Impl {
  Config cfg;
  std::shared_ptr<Communicator> comm;  // every rank: agreements, the step's flags
  int rank = 0, world = 1;
  ShardTopology topo;
  void find_hosts();
  /// Counts a collective this rank sends `bytes` of, over the group's or the replicas' ring.
  void count_sent(bool across_groups, int64_t bytes) {
    collectives.sent_bytes += bytes;
    if (across_groups ? topo.replica_next_remote : topo.shard_next_remote)
      collectives.sent_inter += bytes;
  }
  /// Counts what this rank sends to the others of its shard group point to point: `pieces`'
  /// counts of `bytes_per` bytes each (its own piece is a copy).
  void count_sent(const Pieces& pieces, int64_t bytes_per) {
    for (size_t q = 0; q < pieces.counts.size(); ++q) {
      if (int(q) == topo.shard_rank) continue;
      collectives.sent_bytes += pieces.counts[q] * bytes_per;
      if (q < topo.shard_remote.size() && topo.shard_remote[q])
        collectives.sent_inter += pieces.counts[q] * bytes_per;
    }
  }
  /// What a reduce-scatter or all-gather of unit `id`'s shards within the group sends.
  int64_t group_ring_bytes(int id) const {
    return int64_t(topo.shard_world - 1) * layout(id).shard_numel * int64_t(pbytes);
  }
  std::vector<OptimizerOptions> groups;
  Resources res;
  std::vector<UnitShape> shapes;  // fixed at finalize(); the tiers read them
  std::vector<Unit> units;
  bool finalized = false;
  // What a load that failed after it began writing the state said (load.cpp): until a load
  // succeeds the engine holds no valid state, and check_state() refuses.
  std::string failed_load;
  /// Refuses `call` while the engine holds no valid state (failed_load).
  void check_state(const char* call) const;
  /// Before the master weights or the moments change: waits for a save_async() copying them.
  void before_state_change() {
    if (save.copying) save.copying->wait();
  }
  DType pdt = DType::f32;  // parameter and gradient dtype
  size_t pbytes = 4;

  TierContext tier_ctx;
  std::unique_ptr<ParamTier> params;
  std::unique_ptr<StateTier> state;
  // On a GPU: the state tier's host memory registered with CUDA, so reduced shards come down
  // by DMA. After the tiers, so the registrations end before the memory goes.
  std::vector<std::shared_ptr<void>> dma;

  LossScaler scaler;
  int64_t steps = 0;

  int64_t largest = 0;  // elements of the largest padded unit (stage-3 gather buffers)

  GatherSchedule schedule;
  ReductionQueue reductions;
  CollectiveLog collectives;
  void record(char kind, int unit);
  /// Engine::step() runs: an asynchronous save's writing gives way meanwhile (save.cpp).
  /// Declared before `save`, whose threads read it.
  std::atomic<bool> stepping{false};
  AsyncSave save;
  StepClock clock;
  MuonPlan muon;
  SpeculationPause spec_pause;

  /// `dev`: the device backend (null: the one Config::device names, make_compute()).
  Impl(Config c, std::shared_ptr<Communicator> cm, std::unique_ptr<Compute> dev = nullptr);
  ~Impl();

  /// Records a collective of the step path for the busy-time union.
  std::shared_ptr<Work> track(std::shared_ptr<Work> w) {
    clock.works.push_back(w);
    return w;
  }
  /// Waits for a collective of the step path, counting the wait as exposed communication.
  void wait_for(Work& w);
  /// Waits for a collective. Every wait of the engine on its peers goes through here: with
  /// hierarchical sharding it keeps crossing the groups meanwhile (engine_step.cpp).
  void wait_crossing(Work& w);
  /// A collective over host f32 memory on `on` (one of the engine's), waited for (wait_for()
  /// where `exposed`, else wait_crossing()): given to a host communicator as it is; to NCCL's,
  /// which moves device memory only, through device buffers that the input is copied into on
  /// the compute stream (which the collective follows) and the output is copied out of once
  /// it completed (engine_host_collective.cpp). `count` is the collective's own: all_gather's
  /// send count, reduce_scatter's recv count, all_reduce_sum's count (send == recv).
  enum class CollectiveOp { all_gather, reduce_scatter, all_reduce_sum };
  void host_collective(Communicator& on, CollectiveOp op, const float* send, float* recv,
                       int64_t count, const std::string& what, bool exposed);
  /// The same over f32 device memory of a stream engine (on which every communicator of the
  /// engine moves device memory), following the work issued on the compute stream.
  void device_collective(Communicator& on, CollectiveOp op, const float* send, float* recv,
                         int64_t count, const std::string& what, bool exposed);
  /// all_to_all() of f32 pieces on `on`, waited for as host_collective() waits: over device
  /// memory (`on_device`) as device_collective(); over host memory as host_collective(), the
  /// send buffer's span through a device buffer and each received piece back out of one.
  void exchange_pieces(Communicator& on, bool on_device, const float* send, const Pieces& sends,
                       float* recv, const Pieces& recvs, const std::string& what, bool exposed);
  static std::shared_ptr<Work> start_collective(Communicator& on, CollectiveOp op, const float* in,
                                                float* out, int64_t count, const std::string& what);
  /// How often a wait looks for landed reductions to cross (it wakes at once when its own
  /// collective completes): the most an all-reduce across groups starts late by.
  static constexpr double kCrossPollS = 200e-6;

  void check_options(int group, const OptimizerOptions& o, const char* call) const;
  Unit& unit(UnitId id, const char* call);
  const Unit& unit(UnitId id, const char* call) const;
  const UnitLayout& layout(int id) const { return shapes[size_t(id)].layout; }
  std::string where(int id) const;  // "rank 1, unit 'layer3'"
  int num_states() const;           // optimizer moment buffers: 0, 1 or 2
  std::vector<TensorView> views(int id, void* base) const;

  // engine_agreement.cpp
  void check_same_model();
  void check_same_collectives(const double* sums);

  // engine_setup.cpp
  void make_tiers();
  /// Why Config::speculative_step is not taken ("" when it is); after plan_muon().
  std::string speculation_off() const;
  void load_initial_values();
  void drop_tiers() noexcept;  // a failed finalize() leaves nothing behind (swap files too)

  // engine_gather.cpp
  int take_gather_slot(int id);
  void start_gather(int id);
  void prefetch_after(int id);
  void free_gather(int id);  // the unit's gather buffer back to the pool
  const void* gather_source(int id);

  // engine_grads.cpp
  void* grad_buffer(int id) const;  // the trainer's whole gradient of the unit
  int take_grad_staging(int id);
  std::vector<TensorView> take_grads(int id, int64_t zero_from);
  void issue_reductions();
  /// read_full()/write_full(): the parameter, after checking the unit, the index and that the
  /// shard group's communicator moves host memory.
  const ParamSlot& full_access(UnitId id, int param, const char* call);
  /// grads_ready(): the unit's gradients of this micro-step are complete; `present` says per
  /// parameter whether it had one (null: all did).
  void hand_over(int id, const uint8_t* present);
  /// step(): gives the runs of parameters held this step (Unit::held) the hold group
  /// (index groups.size() of fold_hyper()), and the others their own again.
  void mark_held_runs();
  void start_reduction(int id);
  bool cross_groups(int id);  // the reduced shard's all-reduce across groups, once; true if started
  void land_reduction(int id);  // waits for the reduction, across groups too
  // cross_groups() for the landed reductions in flight, in order; true while one waits to land.
  bool cross_landed();
  void finish_reduction(int id);  // for the trainer: this unit's, and every one issued before
  void finish_in_order(int id);   // the same, at a point of the sequence every rank shares
  void complete_reduction(int id);
  void complete_finished();  // the reductions already done, in order (stages 1–3)

  // engine_muon.cpp
  /// finalize(), before the tiers: the Muon matrices, their owners and buffers (none unless a
  /// group is muon); refuses a Muon parameter of fewer than two dimensions.
  void plan_muon();
  /// finalize(), with Config::checkpoint_async: makes save_async()'s snapshot and starts the
  /// thread that faults it in (src/checkpoint/save.cpp).
  void reserve_snapshot(Engine& e);
  /// TierContext::direction: unit u's Muon direction for the update `a` describes.
  const float* muon_direction(int u, const cpu::UpdateArgs& a);

  // engine_step.cpp
  StepResult step();
  std::pair<double, bool> close_grads();  // finish_micro_steps() + reduce_norm_and_flags(), once
  void finish_micro_steps();
  std::pair<double, bool> reduce_norm_and_flags();
  double grad_scale() const;
  /// The update's hyperparameters for optimizer step `step` (1 for the first).
  std::vector<cpu::UpdateHyper> fold_hyper(double grad_scale, int64_t step) const;
  void drop_prefetches();
  void update(const std::vector<cpu::UpdateHyper>& hyper);
};

}  // namespace zeroshard
