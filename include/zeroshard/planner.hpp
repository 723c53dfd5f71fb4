#pragma once
/// \file planner.hpp
/// What an engine would hold, before anyone allocates it, and how long its step would take.

#include <string>
#include <utility>
#include <vector>

#include "zeroshard/config.hpp"
#include "zeroshard/export.hpp"
#include "zeroshard/memory.hpp"
#include "zeroshard/param.hpp"

namespace zeroshard {

/// One unit as Engine::add_unit() takes it (initial values are ignored).
struct PlanUnit {
  std::string name;
  std::vector<Param> params;
};

/// The bytes rank `rank` of an engine with `cfg` on `world` ranks holds once finalize() has run,
/// by tier × kind and by named buffer: what that engine's Engine::memory() reports, exactly,
/// because it is computed by the engine's own setup (layout, tiers, buffer pools, swap records)
/// with the ledger counting buffers instead of allocating them. The rank's collectives are
/// answered locally (every rank is assumed to register the same model); nvme swap files are
/// laid out in a temporary directory, sparse, and removed, so the configured nvme paths need not
/// exist here. `groups` are the parameter groups after the first (Engine::add_group()).
/// A GPU engine (Config::device cuda) is planned on a stand-in GPU, so no GPU (nor a CUDA build)
/// is needed: the same tiers, with the GPU's staging slots and pinned upload buffers, as on the
/// GPU. Throws Error (invalid_argument or invalid_config) for what the engine itself would
/// refuse.
ZS_API MemoryReport plan_memory(const Config& cfg, const std::vector<PlanUnit>& units, int world,
                                int rank = 0, const std::vector<OptimizerOptions>& groups = {});

/// One stage and offload choice, planned: bytes per tier (every kind) and the model states
/// (parameters, gradients, master weights, optimizer state, on every tier), each of the rank
/// that holds the most (rank 0 or rank world − 1: shards differ only where padding falls; with
/// Muon any rank, whose buffers follow the matrices it orthogonalises).
struct PlanChoice {
  int stage = 0;
  Tier optimizer = Tier::device;  ///< offload_optimizer
  Tier params = Tier::device;     ///< offload_param (stage 3; device below)
  int64_t tier_bytes[kNumTiers] = {};
  int64_t model_states = 0;
  /// The engine's settings for this choice, as planned (what predict_step() takes); nvme paths
  /// are a stand-in where `base` gave none.
  Config config;
};

/// plan_memory() for every stage and offload choice (stages 0–3; optimizer state on the device,
/// host or, from stage 1, nvme tier; at stage 3 parameters on each tier too), with `base`'s other
/// settings: what `zeroshard plan` and zeroshard.estimate() print. Only the choices the engine
/// takes (Config::validate(): a GPU engine's take no stage 0 with the optimizer off the GPU and
/// no parameters off it with the optimizer on it; Muon's no parameters on nvme beside the state
/// in memory); where it takes none, throws the first choice's reason (the base's settings at
/// fault).
ZS_API std::vector<PlanChoice> plan_choices(const Config& base, const std::vector<PlanUnit>& units,
                                            int world,
                                            const std::vector<OptimizerOptions>& groups = {});

/// The buffers a collective runs on, as `zeroshard calibrate` measures them: `warm`, one buffer
/// used again and again (in the caches, as the engine's gradient staging slots are); `cold`, a
/// fresh buffer each call, alone (as the whole gradient and parameter buffers, one per unit, and
/// stage 3's shards, which its gathers read); `queued`, fresh buffers with many calls in flight at
/// once, as the engine issues the whole buffers' collectives: stages 0–1 reduce every unit's
/// gradients as backward hands it over, stages 1–2 gather every unit's new parameters at once after
/// the update. (Stage 0 gathers each reduced unit back on its own: cold.)
enum class Buffers { warm, cold, queued };

/// The time of one collective call of `bytes`, as `zeroshard calibrate` counts them: a
/// reduce-scatter's output block per rank, an all-gather's input block per rank, an
/// all-reduce's whole buffer. Measured on each kind of Buffers (the caches matter: on a 2-core
/// machine a 4 MiB reduce-scatter ran at 2.7x the bandwidth of a 64 MiB one). Between two
/// measured sizes the time is interpolated; past the largest, bytes / bandwidth_gbs more; below
/// the smallest, its time. A kind not measured takes the next (queued: cold; cold: warm); with no
/// points, latency_s + bytes / bandwidth_gbs.
struct ZS_API CollectiveRate {
  double latency_s = 0;
  double bandwidth_gbs = 0;  ///< 0: not measured (a prediction that needs it throws)
  std::vector<std::pair<double, double>> warm, cold, queued;  ///< (bytes, seconds), increasing
  double seconds(double bytes, Buffers buffers) const;
};

/// Each node's link to the other nodes, per collective kind, as measured between one rank on
/// each of `nodes` nodes (a calibration launched with `mpirun --map-by node`:
/// read_link_calibration()). A collective whose rings send B bytes out of its busiest node
/// (a ring count, StepResult::inter_node_bytes) takes the time measured for the size whose ring
/// sends B out of one node: B / (nodes − 1) for a reduce-scatter's output or an all-gather's
/// input block, B · nodes / (2 (nodes − 1)) for an all-reduce's buffer. Kinds differ: Open MPI's
/// non-blocking reduce-scatter and all-reduce between two hosts moved their bytes at about 0.4
/// and 0.6 of the all-gather's rate over the same link.
struct LinkRates {
  int nodes = 2;
  CollectiveRate reduce_scatter, all_gather, all_reduce;
  /// One bandwidth for every kind (a link typed by hand, GB/s each way; no latency).
  static LinkRates uniform(double gbs) {
    const CollectiveRate c{0, gbs, {}, {}, {}};
    return {2, c, c, c};
  }
};

/// What a step-time prediction takes of one machine, per rank, with every rank of a node at
/// work at once: what `zeroshard calibrate` measures (read_calibration()).
struct MachineRates {
  /// The CPU optimizer update (AdamW) in parameters per second, for the engine's dtype and
  /// moments' format; 0: not measured.
  double update_params_per_s = 0;
  /// all_reduce: the engine's all-reduce of a dtype buffer (Communicator::all_reduce_sum), which
  /// hierarchical sharding runs across its groups.
  CollectiveRate reduce_scatter, all_gather, all_reduce;
  /// A step of the nvme tier (records read, updated, written) in parameters per second; 0: not
  /// measured.
  double nvme_step_params_per_s = 0;
  /// Stage 3's parameter shards on the nvme tier (offload_param nvme), in bytes of shards per
  /// second: read into staging for a gather; computed and written by the update with the
  /// optimizer state in memory (a pass of its own before the state changes); written beside the
  /// state's records with the state on the nvme tier. 0: not measured.
  double param_read_gbs = 0, param_write_gbs = 0, param_write_with_records_gbs = 0;
  /// The trainer's own forward and backward per step (seconds; 0: none, as in a benchmark of
  /// the engine alone): the window that gradient reductions and gathers can hide behind.
  double compute_s = 0;
  /// How much of that window hides collectives on this machine, in [0, 1]: 1 where they run
  /// beside the trainer's computing thread unhindered, 0 where the two take turns, as on 2 cores
  /// shared by 2 ranks and their communication threads (`zeroshard calibrate` measures it as
  /// collectives.overlap). A step hides overlap × min(compute_s, the collectives' time).
  double comm_overlap = 1;
  /// Nodes: this many consecutive ranks share one (0: every rank on one node). A collective
  /// whose rings stay within nodes takes the calibrated rates above; one whose rings cross takes
  /// the bytes its busiest node sends to other nodes (a ring count) over the link, timed as its
  /// kind sends them (LinkRates).
  int ranks_per_node = 0;
  LinkRates link;
  /// A GPU engine's (Config::device cuda), as `zeroshard calibrate --device cuda` measures them:
  /// its update with the optimizer state in GPU memory, in parameters per second, for the
  /// engine's dtype and moments' format (the collectives above are then the GPUs'); and pinned
  /// host memory copied to and from the GPU (PCIe), in GB/s. 0: not measured.
  double gpu_update_params_per_s = 0;
  double h2d_gbs = 0, d2h_gbs = 0;
  /// Muon's Newton–Schulz iteration on the CPU (kernels/cpu/newton_schulz.hpp), as
  /// (multiply-adds of one matrix's iteration, multiply-adds per second) points in increasing
  /// size: a matrix between two points takes the rate interpolated on a log scale, one outside
  /// them the nearest point's. `zeroshard calibrate` measures square matrices; `zeroshard plan
  /// --ns-gflops` types one rate for every size. Empty: not measured.
  std::vector<std::pair<double, double>> newton_schulz;
};

/// The collectives of an engine on `world` ranks sharded in groups of `group` (0: all of them)
/// at a bus bandwidth `bus_gbs` as nccl-tests report it: a ring moves a reduce-scatter's or an
/// all-gather's block of B bytes per rank among n in (n − 1) B / bus, an all-reduce of B bytes
/// among n in 2 (n − 1) / n · B / bus. What a GPU engine's collectives take where no calibration
/// measured them (`zeroshard calibrate` measures the host's), or a CPU engine's typed. Throws
/// Error(invalid_argument) on a bandwidth that is not positive or groups that do not divide
/// the world.
ZS_API void set_bus_bandwidth(MachineRates& rates, double bus_gbs, int world, int group = 0);

/// The bytes one parameter's optimizer update moves in memory for an engine configured as
/// `cfg`: its master read and written, each moment read and written in its format (8-bit: one
/// byte, its block's absmax left out), the gradient read, and the low-precision copy written
/// (an f32 model's master is its parameter). 28 for AdamW with f32 moments, f32 or bf16; what
/// the same-bytes pass of `zeroshard calibrate` moves.
ZS_API double update_bytes_per_param(const Config& cfg);
/// The bytes one parameter's optimizer record holds on the nvme tier (master and moments; 12
/// for AdamW with f32 moments): a step reads and writes each once.
ZS_API double record_bytes_per_param(const Config& cfg);

/// Rates typed by hand, where no calibration measured them or over what it measured (what
/// `zeroshard plan` and zeroshard.estimate() take); 0: not typed.
struct TypedRates {
  double memory_gbs = 0;      ///< a rank's memory bandwidth, as the same-bytes pass measures it
  double disk_gbs = 0;        ///< a rank's share of its disks, reads and writes together
  double bus_gbs = 0;         ///< the collectives' bus bandwidth (set_bus_bandwidth())
  double pcie_gbs = 0;        ///< a GPU's pinned copies, each way
  double gpu_update_gps = 0;  ///< a GPU's update in its memory, G params/s
  double ns_gflops = 0;       ///< Muon's Newton–Schulz iteration on one rank, GFLOP/s
};
/// `rates` with what `typed` gives over them, for an engine configured as `cfg` on `world`
/// ranks: the CPU update at memory_gbs over update_bytes_per_param(); the nvme tier's step at
/// disk_gbs over twice record_bytes_per_param(), and stage 3's shards on it read and written at
/// disk_gbs; the collectives at bus_gbs (set_bus_bandwidth(), in cfg's shard groups); Muon's
/// iteration at ns_gflops for every matrix size (MachineRates::newton_schulz). A GPU
/// engine also takes pcie_gbs and gpu_update_gps, and hides its collectives behind the
/// trainer's compute as far as it lasts (comm_overlap 1: NCCL's own streams); a CPU engine
/// ignores those two. Throws Error(invalid_argument) on a negative rate, or on shard groups
/// that do not divide `world` with bus_gbs.
ZS_API void set_typed_rates(MachineRates& rates, const Config& cfg, int world,
                            const TypedRates& typed);

/// The rates of a calibration file (schema zeroshard-calibration/1) for an engine configured as
/// `cfg`: its dtype, its moments' format (Config::optimizer_state) and its master's
/// (Config::bf16_master). Each format moves its own bytes, so the CPU update and the nvme step
/// have a rate per format. A rate the file does not hold (a file written before formats were
/// measured, or without --nvme-path, or a GPU's without --device cuda) stays 0, and
/// predict_step() then says it is not measured.
/// Throws Error(invalid_argument) naming the file on a missing file, another schema, or a
/// missing or mistyped field.
ZS_API MachineRates read_calibration(const std::string& path, const Config& cfg);
/// The link between nodes from a calibration file written by `zeroshard calibrate` launched with
/// one rank on each node (`mpirun --map-by node`): each collective kind's measured points (on
/// buffers in the caches: the link, not the memory, is what it measures) and the file's rank
/// count as `nodes`. Throws Error(invalid_argument) naming the file on what read_calibration()
/// refuses, on a calibration of one rank, or on a kind it did not measure.
ZS_API LinkRates read_link_calibration(const std::string& path);
/// The name a calibration file keeps cfg's rates under: the moments' format ("f32", "bf16",
/// "8bit"), and "/bf16" after it for a bf16 master ("8bit/bf16"). "f32" rates are the top
/// level of their section, the others under its "state_formats".
ZS_API std::string calibration_format(const Config& cfg);

/// A step of an engine (optimizer on the device or host tier, or nvme), in seconds, split as
/// it is spent. Communication is what the trainer waits for: the reduction of the gradients
/// (a reduce-scatter, and at stage 0 an all-gather of the reduced shards) and the stage-3 gathers
/// (one per unit in forward and one in backward), beyond what compute_s hides of them
/// (MachineRates::comm_overlap), and the parameters' all-gather after the update (stages 1–2),
/// which nothing hides.
struct StepPrediction {
  double compute_s = 0;
  double comm_s = 0;  ///< exposed communication
  /// The update in memory: on the CPU, or on the GPU where a GPU engine keeps its optimizer
  /// state there.
  double optimizer_s = 0;
  /// Muon: the Newton–Schulz iteration, included in optimizer_s. Each unit's matrices are
  /// orthogonalised by their owners (cpu::assign_owners()) before the unit's update, and the
  /// unit waits for its slowest rank: the sum over units of the busiest rank's iteration. Its
  /// exchange (an all-gather and a reduce-scatter of f32 directions per unit over the shard group,
  /// an all-reduce at stage 0) runs after backward and is in comm_s, hidden by nothing.
  double newton_schulz_s = 0;
  /// A GPU engine's copies between its memory and pinned host memory that the step waits for:
  /// the reduced gradient shards going down to a CPU optimizer (beside the reductions, hidden
  /// with them); the new parameters going up, each unit's as the CPU update finishes it (a
  /// pipeline: what the uploads add to the update, at least the last unit's); and stage 3's
  /// shards off the GPU going up before each gather, on the compute stream the trainer's kernels
  /// share (hidden by nothing).
  double pcie_s = 0;
  /// The nvme tier's step (its update included), and with parameters on the nvme tier their
  /// reads beyond what the gathers' collectives hide and their writes after the update.
  double nvme_s = 0;
  /// Config::speculative_step (where the engine takes it): the update runs during backward,
  /// each unit's as soon as its gradient has landed (backward taken as 2/3 of compute_s, each
  /// unit's part of it by its parameters) and the unit before it is done, at the update's rate
  /// over its bytes plus the second copy's (read for ownership) and the gradient's norm pass
  /// (update_bytes_per_param() + record_bytes_per_param() + the gradient), or on the nvme tier
  /// at its step's rate (the same bytes on disk); optimizer_s (nvme: nvme_s) is then what is
  /// left of the update after backward, and the new parameters all go up after it (pcie_s).
  /// rollback_s: the update of a step that keeps no speculation (it clips or overflows), all
  /// of it after backward; 0 without speculation.
  double rollback_s = 0;
  double total_s = 0;  ///< compute_s + comm_s + optimizer_s + pcie_s + nvme_s
  /// Bytes the busiest node sends to other nodes per step (ring count, as the engine counts).
  double inter_node_bytes = 0;
};

/// The step of rank 0 of an engine with `cfg` on `world` ranks, from the same unit layout the
/// engine allocates with. Stage 3's parameters on the host tier are a CPU engine's memory, as on
/// the device tier; on the nvme tier every gather reads the rank's shard first (ahead, in the
/// recorded order, so the reads and the gathers' collectives run side by side and the slower
/// sets the pace) and the update writes every new shard. A GPU engine (Config::device cuda)
/// adds its host↔GPU copies (StepPrediction::pcie_s) and updates in GPU memory at
/// MachineRates::gpu_update_params_per_s. `groups` are the parameter groups after the first
/// (Engine::add_group()), as plan_memory() takes them: a Muon engine's matrices are those in its
/// muon groups, and its update is timed at the AdamW rate (the same streams but one moment
/// fewer and the direction read). Throws Error(invalid_argument) for a rate it needs that is 0,
/// Error(invalid_config) for a configuration the engine refuses (Config::validate(), with nvme
/// paths not needed).
ZS_API StepPrediction predict_step(const Config& cfg, const std::vector<PlanUnit>& units, int world,
                                   const MachineRates& rates,
                                   const std::vector<OptimizerOptions>& groups = {});

}  // namespace zeroshard
