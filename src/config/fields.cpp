// The field table of Config (include/zeroshard/config_fields.hpp) and what is computed from it
// alone: the fingerprint, value names and the "did you mean" rule.
//
// Adding a field: declare it in config.hpp and add its row below, with its JSON key, its
// single-field rules and whether ranks must agree on it. The JSON reader, validate(), the
// Python bindings and the fingerprint then know it, and tests/unit/test_config_fields.cpp
// round-trips it through JSON (its count of rows guards against a member without one). Only a
// rule across fields (validate.cpp) or a DeepSpeed key that is not one field (json.cpp) needs
// code.

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "base/edit_distance.hpp"
#include "src/config/internal.hpp"

namespace zeroshard {

const char* optimizer_name(OptimizerKind k) {
  switch (k) {
    case OptimizerKind::adam:
      return "adam";
    case OptimizerKind::adamw:
      return "adamw";
    case OptimizerKind::sgd:
      return "sgd";
    case OptimizerKind::lion:
      return "lion";
    case OptimizerKind::muon:
      return "muon";
  }
  return "unknown";
}

bool group_kind_allowed(OptimizerKind engine, OptimizerKind group) {
  if (engine == group) return true;
  return engine == OptimizerKind::muon &&
         (group == OptimizerKind::adam || group == OptimizerKind::adamw);
}

const char* speculative_step_name(SpeculativeStep s) {
  switch (s) {
    case SpeculativeStep::off:
      return "off";
    case SpeculativeStep::on:
      return "on";
    case SpeculativeStep::automatic:
      return "auto";
  }
  return "unknown";
}

const char* state_format_name(StateFormat f) {
  switch (f) {
    case StateFormat::f32:
      return "f32";
    case StateFormat::bf16:
      return "bf16";
    case StateFormat::q8:
      return "8bit";
  }
  return "unknown";
}

namespace {

// The rules' texts are the messages users see (and tests check); the conditions are written so
// that NaN fails them.
constexpr FieldRule kAtLeast1 = {[](double v) { return v >= 1; }, "must be >= 1"};
constexpr FieldRule kFiniteNonNegative = {[](double v) { return v >= 0 && std::isfinite(v); },
                                          "must be finite and >= 0"};
constexpr FieldRule kFinitePositive = {[](double v) { return v > 0 && std::isfinite(v); },
                                       "must be finite and > 0"};
// Padding is computed in elements as world_size × alignment: far below 2^63 whatever the world.
constexpr FieldRule kAlignmentBound = {[](double v) { return v <= double(1 << 20); },
                                       "must be <= 1048576 (2^20 elements)"};
constexpr FieldRule kUnitInterval = {[](double v) { return v >= 0 && v < 1; }, "must be in [0, 1)"};

}  // namespace

template <>
std::span<const FieldInfo<OptimizerOptions>> config_fields<OptimizerOptions>() {
  using O = OptimizerOptions;
  // JSON section "optimizer.params" (Config's row). "type" and "betas" are read by hand:
  // DeepSpeed's type names a family (Adam means AdamW) and resets the group's defaults.
  static const FieldInfo<O> rows[] = {
      {.name = "kind", .member = &O::kind, .json_by_hand = true},
      {.name = "lr", .member = &O::lr, .json = "lr", .rules = {kFiniteNonNegative}},
      {.name = "beta1",
       .member = &O::beta1,
       .json = "betas[0]",
       .json_by_hand = true,
       .rules = {kUnitInterval}},
      {.name = "beta2",
       .member = &O::beta2,
       .json = "betas[1]",
       .json_by_hand = true,
       .rules = {kUnitInterval}},
      {.name = "eps", .member = &O::eps, .json = "eps", .rules = {kFinitePositive}},
      {.name = "weight_decay",
       .member = &O::weight_decay,
       .json = "weight_decay",
       .rules = {{[](double v) { return v >= 0; },
                  "must be >= 0 (>= 1 with dynamic scaling, loss_scale 0)"}}},
      {.name = "momentum",
       .member = &O::momentum,
       .json = "momentum",
       .rules = {{[](double v) { return v >= 0; },
                  "must be >= 0 (>= 1 with dynamic scaling, loss_scale 0)"}}},
      {.name = "nesterov", .member = &O::nesterov, .json = "nesterov"},
      {.name = "ns_steps",
       .member = &O::ns_steps,
       .json = "ns_steps",
       .rules = {{[](double v) { return v >= 1 && v <= 100; }, "must be in [1, 100]"}}},
      {.name = "ns_bf16", .member = &O::ns_bf16, .json = "ns_bf16"},
      {.name = "match_rms_adamw", .member = &O::match_rms_adamw, .json = "match_rms_adamw"},
  };
  return rows;
}

template <>
std::span<const FieldInfo<OffloadOptions>> config_fields<OffloadOptions>() {
  using O = OffloadOptions;
  // JSON sections "zero_optimization.offload_optimizer" and ".offload_param" (Config's rows).
  static const FieldInfo<O> rows[] = {
      {.name = "tier", .member = &O::tier, .json = "device", .alias = "device"},
      // Each rank may swap to its own disks; where the bytes go changes no collective.
      {.name = "nvme_paths",
       .member = &O::nvme_paths,
       .json = "nvme_path",
       .fingerprint = false,
       .alias = "nvme_path"},
      // Pipeline depth and pinning of this rank's staging memory: local, like the paths.
      {.name = "buffer_count",
       .member = &O::buffer_count,
       .json = "buffer_count",
       .fingerprint = false,
       .rules = {kAtLeast1}},
      {.name = "pin_memory", .member = &O::pin_memory, .json = "pin_memory", .fingerprint = false},
  };
  return rows;
}

template <>
std::span<const FieldInfo<LossScaleOptions>> config_fields<LossScaleOptions>() {
  using O = LossScaleOptions;
  // JSON section "fp16" (Config's row), with DeepSpeed's names. Checked whatever the dtype, so
  // a bad value does not lie in wait for the day the user switches fp16 on.
  static const FieldInfo<O> rows[] = {
      {.name = "static_scale",
       .member = &O::static_scale,
       .json = "loss_scale",
       .rules = {{[](double v) { return v >= 0 && std::isfinite(v); },
                  "must be finite and >= 0 (0 = dynamic scaling)"}}},
      {.name = "initial_scale_power",
       .member = &O::initial_scale_power,
       .json = "initial_scale_power",
       .rules = {{[](double v) { return v >= 0 && v <= 64; }, "is out of range (0..64)"}}},
      // 0 is valid with a static scale, where no window is counted (validate.cpp).
      {.name = "window",
       .member = &O::window,
       .json = "loss_scale_window",
       .rules = {{[](double v) { return v >= 0; },
                  "must be >= 0 (>= 1 with dynamic scaling, loss_scale 0)"}}},
      {.name = "hysteresis", .member = &O::hysteresis, .json = "hysteresis", .rules = {kAtLeast1}},
      {.name = "min_scale",
       .member = &O::min_scale,
       .json = "min_loss_scale",
       .rules = {kFinitePositive}},
      {.name = "consecutive_hysteresis",
       .member = &O::consecutive_hysteresis,
       .json = "consecutive_hysteresis"},
  };
  return rows;
}

template <>
std::span<const FieldInfo<AioOptions>> config_fields<AioOptions>() {
  using O = AioOptions;
  // JSON section "aio". This rank's I/O request sizes: local, so outside the fingerprint.
  static const FieldInfo<O> rows[] = {
      // O_DIRECT needs requests aligned to the logical block size; 4096 covers every NVMe
      // format. (Sizes beyond 2^53, inexact as doubles, fail the second rule anyway.)
      {.name = "block_size",
       .member = &O::block_size,
       .json = "block_size",
       .fingerprint = false,
       .rules = {{[](double v) { return v > 0 && std::fmod(v, 4096) == 0; },
                  "must be a positive multiple of 4096 (O_DIRECT alignment)"},
                 {[](double v) { return v <= double(int64_t(1) << 30); },
                  "must be at most 1 GiB (one io_uring request)"}}},
      {.name = "queue_depth",
       .member = &O::queue_depth,
       .json = "queue_depth",
       .fingerprint = false,
       .rules = {kAtLeast1,
                 {[](double v) { return v <= 4096; },
                  "must be at most 4096 (io_uring ring entries)"}}},
  };
  return rows;
}

template <>
std::span<const FieldInfo<Config>> config_fields<Config>() {
  using C = Config;
  static const FieldInfo<C> rows[] = {
      {.name = "stage",
       .member = &C::stage,
       .json = "zero_optimization.stage",
       .rules = {{[](double v) { return v >= 0 && v <= 3; }, "is out of range (0..3)"}}},
      // The GPU backend issues its collectives through NCCL, the CPU one through MPI.
      {.name = "device", .member = &C::device, .json = "zeroshard.device"},
      // Each rank picks its own GPU (−1: by local rank), so ranks differ here by design.
      {.name = "device_index",
       .member = &C::device_index,
       .json = "zeroshard.device_index",
       .fingerprint = false,
       .rules = {{[](double v) { return v >= -1; },
                  "must be >= 0, or -1 for the local rank's GPU"}}},
      // How the CPU device runs its work changes no collective: ranks may differ.
      {.name = "async_device",
       .member = &C::async_device,
       .json = "zeroshard.async_device",
       .fingerprint = false},
      // Set from DeepSpeed's fp16.enabled / bf16.enabled, read together (json.cpp).
      {.name = "dtype", .member = &C::dtype, .json_by_hand = true},
      {.name = "optimizer_state",
       .member = &C::optimizer_state,
       .json = "zeroshard.optimizer_state"},
      {.name = "bf16_master", .member = &C::bf16_master, .json = "zeroshard.bf16_master"},
      {.name = "state_block",
       .member = &C::state_block,
       .json = "zeroshard.state_block",
       .rules = {{[](double v) {
                    return v >= 64 && v <= 4096 && (int64_t(v) & (int64_t(v) - 1)) == 0;
                  },
                  "must be a power of two from 64 to 4096"}}},
      {.name = "loss_scale", .member = &C::loss_scale, .json = "fp16"},
      {.name = "gradient_clipping",
       .member = &C::gradient_clipping,
       .json = "gradient_clipping",
       .rules = {{[](double v) { return v >= 0 && std::isfinite(v); },
                  "must be finite and >= 0 (0 disables clipping)"}}},
      {.name = "gradient_accumulation_steps",
       .member = &C::gradient_accumulation_steps,
       .json = "gradient_accumulation_steps",
       .rules = {kAtLeast1}},
      {.name = "train_batch_size",
       .member = &C::train_batch_size,
       .json = "train_batch_size",
       .rules = {{[](double v) { return v >= 0; }, "must be >= 0 (0: not given)"}}},
      {.name = "train_micro_batch_size_per_gpu",
       .member = &C::train_micro_batch_size_per_gpu,
       .json = "train_micro_batch_size_per_gpu",
       .rules = {{[](double v) { return v >= 0; }, "must be >= 0 (0: not given)"}}},
      {.name = "optimizer", .member = &C::optimizer, .json = "optimizer.params"},
      {.name = "offload_optimizer",
       .member = &C::offload_optimizer,
       .json = "zero_optimization.offload_optimizer"},
      {.name = "offload_param",
       .member = &C::offload_param,
       .json = "zero_optimization.offload_param"},
      {.name = "aio", .member = &C::aio, .json = "aio"},
      {.name = "shard_alignment",
       .member = &C::shard_alignment,
       .json = "zeroshard.shard_alignment",
       .rules = {kAtLeast1, kAlignmentBound}},
      // The groups decide which ranks every collective joins.
      {.name = "shard_group_size",
       .member = &C::shard_group_size,
       .json = "zeroshard.shard_group_size",
       .rules = {{[](double v) { return v >= 0; },
                  "must be >= 0 (0: one group of every rank, flat sharding)"}}},
      // A rank with fewer buffers waits for (or refuses) a unit that the others reduce.
      {.name = "grad_buffers",
       .member = &C::grad_buffers,
       .json = "zeroshard.grad_buffers",
       .rules = {kAtLeast1}},
      {.name = "max_live_units",
       .member = &C::max_live_units,
       .json = "zeroshard.max_live_units",
       .rules = {kAtLeast1}},
      // Prefetching issues the next unit's all-gather early: the order of collectives changes.
      {.name = "prefetch", .member = &C::prefetch, .json = "zeroshard.prefetch"},
      // Read-ahead of this rank's swap files: local I/O.
      {.name = "swap_read_ahead",
       .member = &C::swap_read_ahead,
       .json = "zeroshard.swap_read_ahead",
       .fingerprint = false,
       .rules = {{[](double v) { return v >= 0; }, "must be >= 0 (0 = automatic)"}}},
      // Whether grads_ready() starts the reduction at once or step() does.
      {.name = "overlap_comm",
       .member = &C::overlap_comm,
       .json = "zero_optimization.overlap_comm"},
      // Bitwise the step without it, and it adds no collective: a local choice.
      {.name = "speculative_step",
       .member = &C::speculative_step,
       .json = "zeroshard.speculative_step",
       .fingerprint = false},
      // How long this rank waits: a local patience, not part of what the ranks compute.
      {.name = "collective_timeout_s",
       .member = &C::collective_timeout_s,
       .json = "zeroshard.collective_timeout_s",
       .fingerprint = false,
       .rules = {{[](double v) { return v > 0 && std::isfinite(v); }, "must be finite and > 0"}}},
      // Only rank 0 prunes the checkpoint root.
      {.name = "checkpoint_keep_last",
       .member = &C::checkpoint_keep_last,
       .json = "zeroshard.checkpoint_keep_last",
       .fingerprint = false,
       .rules = {{[](double v) { return v >= 0; }, "must be >= 0 (0 = keep every tag)"}}},
      // Memory this rank reserves for its own saves.
      {.name = "checkpoint_async",
       .member = &C::checkpoint_async,
       .json = "zeroshard.checkpoint_async",
       .fingerprint = false},
      // Stored for DeepSpeed compatibility and read by nothing (the unit is the grain).
      {.name = "reduce_bucket_size",
       .member = &C::reduce_bucket_size,
       .json = "zero_optimization.reduce_bucket_size",
       .fingerprint = false,
       .rules = {{[](double v) { return v >= 0; }, "must be >= 0"}}},
      {.name = "allgather_bucket_size",
       .member = &C::allgather_bucket_size,
       .json = "zero_optimization.allgather_bucket_size",
       .fingerprint = false,
       .rules = {{[](double v) { return v >= 0; }, "must be >= 0"}}},
  };
  return rows;
}

std::string_view closest_name(std::string_view key, const std::vector<std::string_view>& names) {
  std::string_view best;
  size_t best_d = std::max<size_t>(2, key.size() / 3) + 1;
  for (std::string_view n : names) {
    const size_t d = edit_distance(key, n);
    // d < n.size(): replacing the whole name is no typo of it ("x" is not a typo of "lr").
    if (d < best_d && d < n.size()) best = n, best_d = d;
  }
  return best;
}

std::string Config::fingerprint() const {
  std::string out;
  config_detail::for_each_field<Config>(
      *this, "", "",
      [&](const auto& row, const auto& value, const std::string& name, const std::string&) {
        if (row.fingerprint)
          out += "config " + name + "=" + config_detail::show_value(value) + "\n";
      });
  return out;
}

namespace config_detail {

void fail(const std::string& what) {
  throw Error(ErrorCode::invalid_config, kPrefix + what);
}

std::string show_value(bool v) {
  return show(v);
}
std::string show_value(int v) {
  return show(v);
}
std::string show_value(int64_t v) {
  return show(v);
}
std::string show_value(float v) {
  return show(v);
}
std::string show_value(double v) {
  return show(v);
}
std::string show_value(const std::vector<std::string>& v) {
  std::string out;
  for (const std::string& s : v) out += (out.empty() ? "" : ",") + s;
  return out;
}
std::string show_value(DType v) {
  return dtype_name(v);
}
std::string show_value(Device v) {
  return v == Device::cuda ? "cuda" : "cpu";
}
std::string show_value(Tier v) {
  return tier_name(v);
}
std::string show_value(OptimizerKind v) {
  return optimizer_name(v);
}
std::string show_value(StateFormat v) {
  return state_format_name(v);
}
std::string show_value(SpeculativeStep v) {
  return speculative_step_name(v);
}

const char* deepspeed_tier_name(Tier t) {
  switch (t) {
    case Tier::device:
      return "none";
    case Tier::host:
      return "cpu";
    case Tier::nvme:
      return "nvme";
  }
  return "unknown";
}

}  // namespace config_detail
}  // namespace zeroshard
