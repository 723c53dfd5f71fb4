#pragma once
/// \file config.hpp
/// Engine configuration: a plain struct with defaults, and a JSON reader that also accepts the
/// DeepSpeed keys that have a meaning here.

#include <cstdint>
#include <filesystem>
#include <string>
#include <string_view>
#include <vector>

#include "zeroshard/export.hpp"
#include "zeroshard/types.hpp"

namespace zeroshard {

enum class OptimizerKind : uint8_t { adam, adamw, sgd, lion, muon };
ZS_API const char* optimizer_name(OptimizerKind k);

/// How the optimizer moments (Adam's m and v, Lion's and SGD's momentum) are stored, on every
/// tier and in checkpoints; the master weights stay f32 unless Config::bf16_master says.
/// - f32: IEEE binary32 (4 bytes per moment).
/// - bf16: rounded to nearest even after every update (2 bytes). Exact: the update itself runs
///   in f32 on the widened values.
/// - q8 ("8bit"): blockwise 8-bit quantization: each block of Config::state_block elements
///   keeps one f32 absmax and one byte per element, the code of the nearest point to
///   value / absmax among small floats, 8 per binade (zeroshard/quantize.hpp): signed, down to
///   1.25 · 2^-16, for the first moment and momentum; unsigned, down to 1.25 · 2^-32, for
///   Adam's second moment. 1 byte per moment plus 4 per block.
enum class StateFormat : uint8_t { f32, bf16, q8 };
/// "f32", "bf16" or "8bit".
ZS_API const char* state_format_name(StateFormat f);

/// Config::speculative_step: off, on, or automatic ("auto"): on where it pays at little cost, a
/// GPU engine (or the asynchronous CPU device playing one) with the optimizer state on the nvme
/// tier, where it costs the new low-precision parameters once more in memory and no disk.
enum class SpeculativeStep : uint8_t { off, on, automatic };
/// "off", "on" or "auto".
ZS_API const char* speculative_step_name(SpeculativeStep s);

/// Hyperparameters of one parameter group. Group 0 is Config::optimizer; more groups are added
/// with Engine::add_group(). Meaning per optimizer:
/// - adam / adamw: lr, beta1, beta2, eps, weight_decay (adam adds wd·p to the gradient,
///   adamw decays p by lr·wd before the update); bias-corrected moments.
/// - sgd: lr, momentum, nesterov, weight_decay (added to the gradient); no dampening.
/// - lion: lr, beta1 (interpolation), beta2 (momentum decay), weight_decay (decoupled).
/// - muon: lr, momentum, nesterov, weight_decay (decoupled), eps (of the normalisation), ns_steps,
///   ns_bf16, match_rms_adamw, as torch.optim.Muon: buf = momentum·buf + (1 − momentum)·g; the
///   direction (nesterov: (1 − momentum)·g + momentum·buf, else buf) of each matrix is
///   orthogonalised by ns_steps Newton–Schulz iterations; p = p − lr·wd·p − lr·adjust·O.
///   Parameters of two or more dimensions only (a matrix of shape[0] rows); an engine whose
///   optimizer is muon also takes adam and adamw groups, for the embeddings, the head, the
///   norms and the biases (docs/muon.md).
struct OptimizerOptions {
  OptimizerKind kind = OptimizerKind::adamw;
  float lr = 1e-3f;
  float beta1 = 0.9f;
  float beta2 = 0.999f;
  float eps = 1e-8f;
  float weight_decay = 0.01f;
  float momentum = 0.0f;
  bool nesterov = false;
  int ns_steps = 5;      ///< muon: Newton–Schulz iterations
  bool ns_bf16 = false;  ///< muon: the iteration's matrices rounded to bf16 (torch's choice)
  /// muon: how the learning rate scales with a matrix's shape (A rows, B columns): by
  /// max(1, A/B)^0.5 (Jordan et al., torch's "original"), or, when set, by 0.2 · max(A, B)^0.5
  /// (Liu et al.: the update's RMS matches AdamW's; torch's "match_rms_adamw").
  bool match_rms_adamw = false;
};
/// Whether a group of kind `group` may sit in an engine whose optimizer is `engine`: the same
/// kind, or adam/adamw beside muon.
ZS_API bool group_kind_allowed(OptimizerKind engine, OptimizerKind group);

/// Where one kind of state lives (DeepSpeed's offload_optimizer / offload_param).
///
/// The nvme tier keeps one swap file per rank, tier and path, in a per-run directory
/// `<path>/zeroshard-<pid>-<n>-rank<r>/` (mode 0700, files 0600) that is removed when the engine
/// is destroyed; a directory left by a run that crashed is reported on stderr and removed at the
/// next finalize(). Stripes of AioOptions::block_size bytes rotate over the paths. Records are
/// double-buffered so that a step is committed all at once or not at all: the files take twice
/// the state they hold (see docs/tiers.md). Their space is reserved at finalize(), so a
/// full disk fails there (ErrorCode::no_space) rather than during a step. Gradient shards follow
/// offload_optimizer to nvme through a cache of grad_buffers + 1 pinned slots: the oldest are
/// written out during the backward pass and read back by step(); the last few stay in memory.
struct OffloadOptions {
  Tier tier = Tier::device;             ///< "none" → device, "cpu" → host, "nvme" → nvme
  std::vector<std::string> nvme_paths;  ///< directories striped over for the nvme tier
  /// nvme tier: pinned staging buffers. offload_optimizer: slots of the swap pipeline, each
  /// holding one unit's master weights, optimizer state and gradient shard (at least 2).
  /// offload_param: parameter shards being read for gather() (at least 2).
  int buffer_count = 4;
  bool pin_memory = true;  ///< page-lock host-tier buffers
};

/// io_uring swapper settings (DeepSpeed's "aio").
struct AioOptions {
  int64_t block_size = 1 << 20;  ///< bytes per I/O request
  int queue_depth = 8;           ///< requests in flight per ring
};

/// Dynamic loss scaling, used when dtype is f16 (DeepSpeed "fp16" semantics).
struct LossScaleOptions {
  float static_scale = 0.0f;     ///< > 0: fixed scale, no dynamics ("loss_scale")
  int initial_scale_power = 16;  ///< dynamic scale starts at 2^this
  int window = 1000;             ///< clean steps before the scale doubles
  int hysteresis = 2;            ///< overflows tolerated before the scale halves
  float min_scale = 1.0f;        ///< the scale never drops below this
  /// DeepSpeed's "consecutive_hysteresis": a step without overflow refills the hysteresis, so
  /// only `hysteresis` overflows in a row halve the scale (else any `hysteresis` since the last
  /// change of scale).
  bool consecutive_hysteresis = false;
};

/// The dynamic loss scaler's whole state (f16 training), for checkpoints: a run resumed from it
/// continues the scale's schedule exactly (when it doubles, how many overflows it still
/// tolerates), not only the scale.
struct LossScalerState {
  float scale = 1.0f;
  int hysteresis_left = 0;     ///< overflows still tolerated before the scale halves
  int64_t iteration = 0;       ///< steps recorded, skipped ones included
  int64_t last_overflow = -1;  ///< iteration of the last overflow; -1: none
};

struct ZS_API Config {
  /// ZeRO stage 0 (plain data parallel), 1, 2 or 3; see docs/DESIGN.md for what each shards.
  int stage = 0;
  /// The compute device ("zeroshard.device": "cpu" or "cuda"). Parameters, gradients and the
  /// device tier live in its memory, and the optimizer runs there when its state is on the
  /// device tier (on the CPU when offloaded to host or nvme). cuda needs a CUDA build and a GPU;
  /// it takes every offload_optimizer tier (host and nvme from stage 1), and at stage 3 every
  /// offload_param tier, host or nvme ones with the optimizer on host or nvme too.
  Device device = Device::cpu;
  /// The GPU for device cuda; −1 picks the launcher's local rank modulo the number of GPUs.
  int device_index = -1;
  /// A testing device ("zeroshard.async_device"; the environment's ZEROSHARD_ASYNC_DEVICE=1 or 0
  /// overrides it): device cpu run as a GPU would run it, its work on stream threads after a
  /// seeded random delay, with the GPU's staged tiers, copies and waits, so that a missing wait
  /// shows without a GPU. Results are bitwise device cpu's; it is slower. Only with device cpu,
  /// and it takes what device cuda takes (the GPU's rules of validate() apply).
  bool async_device = false;
  /// Element type of parameters and gradients the trainer sees ("fp16"/"bf16" enabled → f16/bf16).
  /// Master weights are f32 unless bf16_master; the optimizer moments as optimizer_state says.
  DType dtype = DType::f32;
  /// Master weights in bf16 ("zeroshard.bf16_master"), rounded stochastically after every update
  /// (cpu_kernels.hpp): 2 bytes per parameter instead of 4 on their tier, and on the nvme tier
  /// 4 fewer per parameter of disk (two record slots). Rounding to nearest would lose every
  /// update smaller than half a bf16 ulp of the weight (lr·update below 2^-9 relative, most of a
  /// run's late steps); stochastic rounding keeps each update's expected value. Kahan-style
  /// compensation would keep them exactly but store a second bf16 per parameter, saving nothing
  /// over f32. Needs dtype bf16 (the parameters are then the master's own bits) and the update on
  /// the CPU (device cpu, or offload_optimizer cpu or nvme). Checkpoints hold the master as f32
  /// (widened exactly), so they load into an f32-master engine and back bitwise.
  bool bf16_master = false;
  /// Storage of the optimizer moments ("zeroshard.optimizer_state": "f32", "bf16", "8bit").
  StateFormat optimizer_state = StateFormat::f32;
  /// q8: elements per quantization block ("zeroshard.state_block"), a power of two from 64 to
  /// 4096. Blocks are counted from each unit's element 0 and shards are padded to whole blocks
  /// (the padding grain becomes a multiple of it), so a block never straddles two ranks and a
  /// checkpoint loads at any world size without requantizing anything.
  int64_t state_block = 2048;
  LossScaleOptions loss_scale;
  /// Global gradient-norm clipping threshold; 0 disables clipping.
  double gradient_clipping = 0.0;
  /// Micro-steps per optimizer step. The update uses the mean gradient over the micro-steps and
  /// the ranks: summed in f32, then divided by gradient_accumulation_steps × world size (and the
  /// loss scale), as one process would on the whole global batch.
  int gradient_accumulation_steps = 1;
  /// DeepSpeed's batch sizes ("train_batch_size", "train_micro_batch_size_per_gpu"; 0: not
  /// given). The trainer's data loader uses them, not the engine; when both are given the
  /// engine checks, as DeepSpeed does, that train_batch_size = micro × accumulation steps ×
  /// world size (a mismatch would train with another batch than the one configured). DeepSpeed
  /// derives absent accumulation steps from the two; here the error names the value to set,
  /// since the trainer's loop must run that many micro-steps per step().
  int64_t train_batch_size = 0;
  int64_t train_micro_batch_size_per_gpu = 0;
  OptimizerOptions optimizer;  ///< parameter group 0
  OffloadOptions offload_optimizer;
  OffloadOptions offload_param;  ///< stage 3 only
  AioOptions aio;
  /// Shards are padded so each unit's flat buffer is a multiple of world_size × this many elements.
  int64_t shard_alignment = 128;
  /// Hierarchical sharding ("zeroshard.shard_group_size", or DeepSpeed's
  /// "zero_optimization.mics_shard_size"): stages 1–3 shard within groups of this many
  /// consecutive ranks (ranks 0 … n−1, n … 2n−1, …; with mpirun's default mapping, the ranks of
  /// one node) and replicate the shards across the groups, as FSDP's hybrid sharding and
  /// DeepSpeed's MiCS do. Gradients are reduce-scattered within the group and all-reduced across
  /// groups; parameters are all-gathered within the group only, so at stage 3 no gather crosses
  /// a node. Each rank then holds world/n times a flat shard. 0 (or the world size): one group
  /// of every rank, flat sharding. Must divide the world size; stage 0 shards nothing.
  int shard_group_size = 0;
  /// Stage 2/3: whole-unit gradient buffers the trainer writes into before reduction, sized at
  /// finalize() by the grad_buffers largest units (so never more than stage 1's whole
  /// gradients); a trainer that keeps a small unit out while a larger one asks for a buffer
  /// makes one grow, up to grad_buffers × the largest unit. With
  /// offload_optimizer nvme (any stage) also sizes the gradient-shard cache (grad_buffers + 1).
  int grad_buffers = 2;
  /// Stage 3: gathered-unit buffers (in use plus prefetched); must be at least 2.
  int max_live_units = 3;
  /// Stage 3: prefetch the next unit in the recorded gather order.
  bool prefetch = true;
  /// nvme optimizer tier: units read ahead of the one being updated ("zeroshard.swap_read_ahead").
  /// 0 picks offload_optimizer.buffer_count − 2 (at least 1): one slot is being updated and one
  /// written back while the others are read. Must be below offload_optimizer.buffer_count.
  int swap_read_ahead = 0;
  /// Start gradient reduction on the communication thread as soon as grads_ready() is called.
  bool overlap_comm = true;
  /// The speculative step ("zeroshard.speculative_step", or DeepSpeed's
  /// "zero_optimization.offload_optimizer.super_offload"): with the optimizer state on the host
  /// or nvme tier, each unit's update runs on a CPU thread as soon as its reduced gradient is
  /// final, during backward, as if the step will neither overflow nor clip; step() keeps every
  /// update that read exactly what its own would read, and computes the others again (or skips
  /// them, on an overflow), so the result is bitwise the result without it. It costs the
  /// low-precision parameters once more, and on the host tier a second copy of the master
  /// weights and moments (the nvme tier writes the record slot its step would write), which the
  /// ledger counts (docs/tiers.md). It pays where backward runs on another processor (a GPU)
  /// while the CPU is idle. automatic (the default) takes it on a GPU engine with the state on
  /// the nvme tier, pausing for 1, 2, 4 … 64 steps after steps that keep no speculation (a run
  /// that clips every step); on the host tier, where that copy doubles the memory the state
  /// takes, only `on` takes it. Not taken, with the reason printed by rank 0 (for on, or automatic
  /// on a GPU engine with the state offloaded), where the state is on the device tier, the
  /// parameters are on the nvme tier, or a group is Muon.
  SpeculativeStep speculative_step = SpeculativeStep::automatic;
  /// A collective that has not completed after this many seconds fails with ErrorCode::timeout.
  /// Values above 1e8 (about three years) count as 1e8: no timeout, in practice.
  double collective_timeout_s = 300.0;
  /// Engine::save() keeps the newest this many tags of its root, removing older ones (0: all).
  int checkpoint_keep_last = 0;
  /// The run saves with Engine::save_async(): finalize() makes the snapshot those saves copy
  /// into (host memory, this rank's part of a checkpoint, in the ledger and the planner's plan as
  /// "checkpoint_snapshot") and faults it in on a thread of its own while training starts, so the
  /// first save_async() costs the trainer what later ones do (once that thread is done: a save
  /// before then waits for the rest of it). The snapshot's memory is then held from finalize()
  /// on, while the trainer may still hold its own copy of the model. Without it the first
  /// save_async() makes the snapshot, and the step after it waits for that memory's first touch
  /// (seconds for 2 GB on the virtual machines measured, docs/checkpoints.md). Nothing where the
  /// optimizer state is on the nvme tier, whose swap files hold the snapshot.
  bool checkpoint_async = false;
  /// Accepted for DeepSpeed compatibility; the unit is the reduction and gather grain here.
  int64_t reduce_bucket_size = 500000000;
  int64_t allgather_bucket_size = 500000000;

  /// Throws Error(invalid_config) naming the first field with a bad value.
  void validate() const;

  /// Every setting that every rank must agree on, because it changes the sequence of
  /// collectives or the numbers: one line per setting, "config <field path>=<value>\n" (e.g.
  /// "config prefetch=true", "config optimizer.lr=0.001"), in the order of the field table
  /// (config_fields.hpp, whose rows say which fields are left out and why). Engine::finalize()
  /// compares it across ranks, so a rank that disagrees fails there with the setting named.
  std::string fingerprint() const;

  /// Parses a JSON object. Accepts zeroshard's own keys and DeepSpeed's ("zero_optimization",
  /// "fp16", "bf16", "gradient_clipping", "gradient_accumulation_steps", "optimizer", "aio", ...).
  /// An unknown key or a value of the wrong type throws Error(invalid_config) naming the key path,
  /// e.g. "zero_optimization.offload_optimizer.devic".
  static Config from_json(std::string_view text);
  static Config from_json_file(const std::filesystem::path& path);
};

}  // namespace zeroshard
