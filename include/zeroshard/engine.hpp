#pragma once
/// \file engine.hpp
/// The engine: owns a model's units, their shards on every tier, the optimizer and the
/// communication. One engine per model, one per rank, driven by the trainer's thread.

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "zeroshard/communicator.hpp"
#include "zeroshard/config.hpp"
#include "zeroshard/export.hpp"
#include "zeroshard/memory.hpp"
#include "zeroshard/param.hpp"
#include "zeroshard/types.hpp"

namespace zeroshard {

using UnitId = int32_t;

/// What step() did.
struct StepResult {
  bool skipped = false;    ///< an overflow (inf/NaN gradient on any rank) skipped the update
  double grad_norm = 0.0;  ///< global L2 norm of the unscaled, averaged gradients (before clipping)
  double clip_factor = 1.0;  ///< multiplier applied for clipping (1 when not clipped)
  float loss_scale = 1.0f;   ///< the scale the trainer must apply to its next loss
  int64_t step = 0;          ///< optimizer steps taken so far (skipped steps do not count)

  /// Where the time since the previous step() went, in seconds, on this rank:
  double optimizer_s = 0;      ///< the optimizer update itself (communication excluded)
  double newton_schulz_s = 0;  ///< Muon: the part of optimizer_s in the Newton–Schulz iteration
  double comm_busy_s = 0;      ///< wall time with at least one of the engine's collectives running
  double comm_exposed_s = 0;   ///< wall time the trainer's thread waited for collectives
  double interval_s = 0;       ///< wall time since the previous step() returned (or finalize())
  /// Bytes this rank's collectives of the interval sent, counted as a ring schedule over each
  /// communicator's ranks sends them (each rank to the next: (n − 1)/n of the data of a
  /// reduce-scatter or all-gather, twice that of an all-reduce); the step's small all-reduce of
  /// flags is left out. inter_node_bytes: the part sent to a rank on another host (by host
  /// name), which hierarchical sharding (Config::shard_group_size) keeps off the links between
  /// nodes.
  int64_t comm_bytes = 0;
  int64_t inter_node_bytes = 0;
  /// Config::speculative_step: units whose update ran during backward and was kept, and units
  /// whose speculation this step dropped (an overflow, a clip, a held parameter, a changed
  /// hyperparameter) and updated again, or skipped.
  int speculation_kept = 0;
  int speculation_dropped = 0;
  /// Share of communication hidden behind the trainer's compute: 1 − exposed / busy (1 if none).
  double comm_hidden_fraction() const {
    return comm_busy_s > 0 ? 1.0 - std::min(1.0, comm_exposed_s / comm_busy_s) : 1.0;
  }
};

/// Shard geometry of one unit on this rank, in elements.
struct ShardInfo {
  int64_t numel = 0;         ///< parameters in the unit
  int64_t padded_numel = 0;  ///< flat buffer length: a multiple of the shard group's size × the
                             ///< padding grain (shard_alignment; with 8-bit moments its lcm with
                             ///< state_block)
  int64_t shard_offset = 0;  ///< first element of this rank's shard in the flat buffer
  int64_t shard_numel = 0;   ///< padded_numel / the shard group's size
};

/// What Engine::load() restores besides the master weights (DeepSpeed's load_checkpoint choices).
struct LoadOptions {
  /// false: the master weights only, and the parameters rebuilt from them (DeepSpeed's
  /// load_optimizer_states=False, or load_module_only=True): the moments, the step count and the
  /// loss scaler keep the engine's values.
  bool optimizer_states = true;
  /// false: every group's hyperparameters keep the engine's values (DeepSpeed's
  /// load_lr_scheduler_states=False: the trainer's scheduler owns them).
  bool hyperparameters = true;
};

/// A tensor of the model that the engine does not train (a frozen parameter, a persistent
/// buffer), as a checkpoint carries it: its name in the model's state_dict, its dtype as
/// safetensors spells it ("F32", "BF16", "F16", "F64", "I64", "I32", "I16", "I8", "U8", "BOOL"),
/// its shape, and its bytes (row-major).
struct ModuleTensor {
  std::string name;
  std::string dtype;
  std::vector<int64_t> shape;
  std::vector<char> bytes;
};

/// What a checkpoint carries of the model besides the engine's state (Engine::save()'s
/// `module`): the tensors the engine does not train, and other names of trained parameters
/// (tied weights: {name, the registered parameter's name}), so that the checkpoint and its
/// export hold every name of the model's state_dict.
struct ModuleState {
  std::vector<ModuleTensor> tensors;
  std::vector<std::pair<std::string, std::string>> aliases;
  bool empty() const { return tensors.empty() && aliases.empty(); }
};

/// Where this rank stands in the sharding (Config::shard_group_size): it holds shard `rank` of
/// each unit, one of `size` in its group, and the group is `index` of `count` groups, which hold
/// the same shards. Flat sharding: one group, rank and size those of the world.
struct ShardGroup {
  int rank = 0, size = 1, index = 0, count = 1;
};

/// What the nvme tier's swapper moved on this rank since finalize() (all zero without one).
struct SwapStats {
  int64_t bytes_read = 0;     ///< from the swap files
  int64_t bytes_written = 0;  ///< to the swap files
  int64_t requests = 0;       ///< I/O requests, each at most aio.block_size bytes
  int64_t resubmitted = 0;    ///< requests sent again after a short transfer, EINTR or EAGAIN
  double wait_s = 0;          ///< seconds the engine's threads blocked waiting for swap I/O
};

/// On a GPU (Config::device cuda) the views that params(), gather() and grads() return are
/// device memory (TensorView::device cuda), and the engine's kernels and copies run in order on
/// its compute stream (stream()). The trainer's own kernels that write gradients must be queued
/// on that stream before grads_ready(), and those that read parameters after gather() or step()
/// returns; or the trainer hands its stream to the engine with set_stream(). The engine never
/// synchronises the whole device; it waits on its own stream where the host needs a result
/// (the gradient norm, checkpoint reads).
class ZS_API Engine {
 public:
  /// Validates `config` (throws Error(invalid_config)). `comm` may be shared by several engines
  /// as long as all ranks drive them in the same order.
  Engine(Config config, std::shared_ptr<Communicator> comm);
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  /// Adds a parameter group with its own hyperparameters; returns its index (1, 2, ...).
  /// Before finalize() only. Its optimizer kind must equal Config::optimizer.kind.
  int add_group(const OptimizerOptions& options);
  /// Parameter groups: 1 + the add_group() calls.
  int num_groups() const;

  /// Registers a unit: its parameters are flattened in this order into one buffer. Before
  /// finalize() only; names must be unique. Returns the unit's id (0, 1, ... in call order).
  UnitId add_unit(std::string name, std::vector<Param> params);

  /// Plans the layout, checks that every rank registered the same model and configuration
  /// (otherwise throws Error(model_mismatch) on every rank, naming the first difference),
  /// allocates every tier and copies the initial values in. Collective.
  void finalize();

  /// Stages 0–2: the unit's whole parameters, one view per Param, valid for the engine's life
  /// and updated in place by step(). Stage 3: throws unless the unit is gathered.
  std::vector<TensorView> params(UnitId unit) const;

  /// Stage 3: all-gathers the unit's parameters (or waits for the prefetch that already did)
  /// and returns views valid until release(unit); then starts the prefetch of the next unit in
  /// the gather order recorded during the first step. Stages 0–2: returns params(unit).
  /// Collective. Gathering a unit twice without release is an error. A unit still gathered
  /// across step() keeps the values it was gathered with: release units before stepping.
  std::vector<TensorView> gather(UnitId unit);
  /// Stage 3: returns the unit's gather buffer to the pool. Stages 0–2: no-op.
  void release(UnitId unit);

  /// Views of the unit's gradient buffer, one per Param, zeroed, for the trainer to write this
  /// micro-step's gradients (dtype Config::dtype). Valid until grads_ready(unit). In stages 2–3
  /// this takes one of Config::grad_buffers buffers, waiting for an earlier reduction if needed.
  std::vector<TensorView> grads(UnitId unit);
  /// The unit's gradients for this micro-step are complete: starts their reduction on the
  /// communication thread and returns at once (Config::overlap_comm) or after it finishes.
  /// Collective. Each unit must be marked ready once per micro-step.
  void grads_ready(UnitId unit);
  /// The copying form for trainers that keep their own gradient tensors (PyTorch's .grad): checks
  /// one view per Param, on the CPU or the engine's GPU, with the Param's element count and
  /// Config::dtype (else throws
  /// Error(invalid_argument) naming the parameter), copies them into the unit's gradient buffer
  /// and starts the reduction as grads_ready(unit) does. The views may be reused on return.
  /// A view with null data says the parameter got no gradient in this micro-step (it counts as
  /// zeros): a parameter with none in any micro-step on any rank is left as it is by the step
  /// (master, moments and parameters unchanged: torch.optim's rule for a .grad of None; Adam's
  /// bias correction still counts the engine's steps).
  void grads_ready(UnitId unit, const std::vector<TensorView>& grads);

  /// Finishes the reductions, then, after gradient_accumulation_steps micro-steps: one
  /// all-reduce of [sum of squares, overflow flag]; on overflow skips the update (and adjusts the
  /// loss scale) on every rank; else updates every shard with the mean gradient over the
  /// micro-steps and ranks (1 / (steps × world × loss scale)) × clip folded in, and
  /// brings the low-precision parameters up to date. Collective. Throws if a unit missed a
  /// micro-step.
  StepResult step();

  /// Closes this step's gradients early and returns their global L2 norm (unscaled, averaged
  /// over micro-steps and ranks, as StepResult::grad_norm; +inf on overflow), and makes the
  /// coming step() clip at max_norm (0: only Config::gradient_clipping; both set: the smaller).
  /// torch.nn.utils.clip_grad_norm_'s place in a loop: after the last micro-step, before
  /// step(). No gradient may be handed over between it and step() (or zero_grad()). Called
  /// again before step(), the smallest max_norm given applies. Collective.
  double clip_grad_norm(double max_norm);

  /// Forgets the gradients accumulated since the last step (collective-free).
  void zero_grad();

  void set_lr(int group, float lr);
  float lr(int group) const;
  /// Replaces the hyperparameters of a parameter group from the next step() on (what schedulers
  /// that cycle betas or momentum need): lr, betas, eps, weight decay, momentum and nesterov.
  /// Throws Error(invalid_argument) for another optimizer kind, a value out of range, or, after
  /// finalize(), an SGD momentum that turns on or off (its buffer exists or not from then on).
  void set_options(int group, const OptimizerOptions& options);
  const OptimizerOptions& options(int group) const;
  float loss_scale() const;
  LossScalerState loss_scaler_state() const;
  /// Restores a state from loss_scaler_state() (a checkpoint); throws Error(invalid_argument)
  /// for a scale that is not positive or a negative counter.
  void set_loss_scaler_state(const LossScalerState& state);
  int64_t step_count() const;

  int rank() const;
  int world_size() const;
  int num_units() const;
  const std::string& unit_name(UnitId unit) const;
  ShardInfo shard_info(UnitId unit) const;
  ShardGroup shard_group() const;
  const Config& config() const;
  const std::shared_ptr<Communicator>& communicator() const;
  /// Config::device cuda: the compute stream (a cudaStream_t), else null.
  void* stream() const;
  /// Config::device cuda: run the engine's work on the trainer's stream (a cudaStream_t, e.g.
  /// torch.cuda.current_stream().cuda_stream) from now on; null returns to the engine's own.
  /// The legacy default stream, null as a cudaStream_t, is therefore passed as cudaStreamLegacy
  /// (torch's default stream reports cuda_stream 0: pass 1, as DLPack does); the engine's own
  /// stream is non-blocking and not ordered with it.
  /// Waits for the work already issued on the old stream. Throws on the CPU device.
  void set_stream(void* stream);
  /// The unit's parameters as registered (without their initial values).
  std::vector<Param> unit_params(UnitId unit) const;
  /// Whether the optimizer keeps `kind` (master and param always; state1 for Adam/AdamW; state0
  /// for Adam/AdamW, Lion and SGD with momentum).
  bool has_state(StateKind kind) const;

  /// This rank's shard [shard_offset, shard_offset + shard_numel) of one state of a unit, as f32
  /// (also in stage 0, where the state is whole). state0/state1 are the optimizer's moment
  /// buffers (Adam: m, v; SGD: momentum; Lion: m); an absent state throws.
  std::vector<float> read_shard(UnitId unit, StateKind kind) const;

  /// Overwrites this rank's shard of master, state0 or state1 (shard_numel floats, as
  /// read_shard() returns them; padding must be zero). Parameters follow only after
  /// commit_shards(). For restoring a sharded state dict at the same world size.
  void write_shard(UnitId unit, StateKind kind, const std::vector<float>& values);
  /// Collective: rebuilds every low-precision parameter (and, in stage 0, the whole f32 state)
  /// from the shards written with write_shard().
  void commit_shards();

  /// Parameter `param` (its index in the unit) whole, as f32 (its shape's element count, in
  /// order): the master weights, the low-precision parameter, or a moment (DeepSpeed's
  /// safe_get_full_fp32_param and safe_get_full_optimizer_state), at any stage and tier.
  /// Collective over the shard group (an all-gather of the unit's shards; over NCCL through
  /// device buffers), between steps.
  std::vector<float> read_full(UnitId unit, int param, StateKind kind);
  /// The reduced gradient of one parameter, whole, in f32 (DeepSpeed's safe_get_full_grad): the
  /// mean over the ranks and micro-steps, unscaled by the loss scale, before clipping — what the
  /// update would read with a clip factor of 1. Call it after the step's last micro-step and
  /// before step(); like clip_grad_norm() it closes the micro-steps (every rank, same order).
  /// Zeros for a parameter no rank had a gradient for. Collective over every rank.
  std::vector<float> read_full_grad(UnitId unit, int param);
  /// Overwrites parameter `param` of master, state0 or state1 with `values` (whole, f32; every
  /// rank passes the same, which is checked), each rank keeping its shard, then rebuilds the
  /// parameters as commit_shards() does (DeepSpeed's safe_set_full_fp32_param and
  /// safe_set_full_optimizer_state). Collective, between steps.
  void write_full(UnitId unit, int param, StateKind kind, const std::vector<float>& values);
  /// Restores the optimizer step count (bias correction) and the loss scale of a saved state.
  void set_step_count(int64_t steps);
  void set_loss_scale(float scale);

  /// Collective: writes a checkpoint any world size and any stage can load, as the tag
  /// directory root/<tag> (default tag "step<8-digit step count>"), and points root/latest at
  /// it. Crash-safe: the tag is written under a temporary name, every file fsynced, then renamed
  /// into place, and `latest` is replaced last, so a save that dies at any point (a killed job,
  /// a full disk) leaves the previous tags and `latest` intact. A save never modifies an
  /// existing tag (Error(invalid_argument) if it exists). Every file is checksummed per block.
  /// Each rank writes the part of each unit its shard holds, unit by unit: nothing is gathered.
  /// Keeps the newest Config::checkpoint_keep_last tags (0: all). Returns root/<tag>.
  /// `module`: rank 0's is written beside the state (module.safetensors, checksummed, of this
  /// save), the other ranks' are not read; read_module_state() reads it back and
  /// export_checkpoint() exports it. A name that is not new is Error(invalid_argument).
  std::filesystem::path save(const std::filesystem::path& root, const std::string& tag = "",
                             const ModuleState& module = {});
  /// Collective: save() without waiting for the disk. The checkpoint holds the state as it is
  /// now: this rank's part of it is copied into a snapshot (host memory, in the ledger as the
  /// buffer "checkpoint_snapshot"; where the state lies in host memory the save's thread makes
  /// the copy, and the next change of the state waits for it) and a thread writes the files
  /// while training goes on (at nice 19; from a snapshot in memory it writes nothing new while
  /// step() runs, so that a step whose update fills the CPU is not slowed by it);
  /// finish_save() (collective) waits for them and publishes the tag. The snapshot's memory is
  /// kept for the next save_async() (a fresh buffer's page faults cost more than the copy) and
  /// freed with the engine; with Config::checkpoint_async, finalize() makes it. A save(),
  /// save_async() or load() finishes a pending save first; destroying the engine with one
  /// pending abandons it (no tag appears; the next save removes its files).
  void save_async(const std::filesystem::path& root, const std::string& tag = "",
                  const ModuleState& module = {});
  /// Collective: completes the pending save_async() and returns its tag's path (empty if none
  /// is pending). Throws the save's error on every rank if a rank failed to write.
  std::filesystem::path finish_save();
  /// Collective: loads the checkpoint at `path`, a tag directory or a root (whose `latest` it
  /// follows), written at any world size or stage. Checks before changing anything the
  /// manifest, the model (unit and parameter names, shapes, order, optimizer; else
  /// Error(invalid_argument) naming the first difference) and every data file's header and
  /// checksum table: a load refused there leaves the engine as it was. Then reads each block
  /// once, verifying it as it lands (Error(corrupted) naming file, block and offset): a load
  /// that fails there, on any rank, leaves every rank's engine holding no valid state, and
  /// step(), gather(), save() and save_async() refuse until a load succeeds. Restores master
  /// weights, optimizer state, the step count, the loss scaler's state and every group's
  /// hyperparameters (as `options` says); parameters are rebuilt from the master weights, and
  /// stage-3 prefetches are dropped. A root without `latest` is refused, naming the tags it holds.
  void load(const std::filesystem::path& path, const LoadOptions& options = {});
  /// Collective: starts from pretrained weights in a safetensors file (F32, BF16 or F16
  /// tensors named as export_checkpoint() names them, e.g. a model.safetensors it wrote or
  /// torch's state_dict saved with safetensors): each rank reads its shard's range of every
  /// unit, and the values become the master weights (parameters rebuilt from them). Optimizer
  /// state and step stay as they are. A missing tensor or a wrong shape or dtype is
  /// Error(invalid_argument) naming it, before any state changes.
  void load_safetensors(const std::filesystem::path& file);

  /// The ledger: bytes held by tier × kind on this rank, with peaks. The nvme column counts
  /// swap-file bytes: one copy of each state under its kind, and the rest of the files (the
  /// second slot of every double-buffered record, alignment) as the buffer "swap_reserve".
  MemoryReport memory() const;

  /// nvme tier: the swapper's counters on this rank.
  SwapStats swap_stats() const;
  /// nvme tier: this rank's swap files (one per tier and nvme path), empty without one. They
  /// are removed when the engine is destroyed.
  std::vector<std::string> swap_files() const;

 private:
  friend struct PlanAccess;  // plan_memory() (zeroshard/planner.hpp) runs finalize() as a plan
  struct ZS_HIDDEN Impl;
  explicit Engine(std::unique_ptr<Impl> impl);  // PlanAccess: an engine on a plan's device
  std::unique_ptr<Impl> impl_;
};

}  // namespace zeroshard
