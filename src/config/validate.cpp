// Config::validate(): first every field's own rules from the table (fields.cpp), in table order,
// then the rules that relate fields to each other, written out below. Fields are named by their
// JSON path because that is what users edit; the conditions are written so that NaN fails them.

#include <cmath>
#include <string>
#include <type_traits>

#include "src/config/internal.hpp"

namespace zeroshard {
namespace {

using config_detail::fail;
using config_detail::show;

template <class T>
void require(bool ok, const std::string& field, T value, const std::string& rule) {
  if (!ok) fail(field + " = " + show(value) + " " + rule);
}

// The table's single-field rules.
void check_field_rules(const Config& c) {
  config_detail::for_each_field<Config>(
      c, "", "",
      [](const auto& row, const auto& value, const std::string&, const std::string& json) {
        using T = std::decay_t<decltype(value)>;
        if constexpr (std::is_arithmetic_v<T> && !std::is_same_v<T, bool>) {
          for (const FieldRule& r : row.rules) {
            if (!r.ok) break;
            require(r.ok(static_cast<double>(value)), json, value, r.text);
          }
        }
      });
}

void check_nvme_paths(const OffloadOptions& o, const std::string& key) {
  // The nvme tier stripes over these directories; without one there is nowhere to swap to.
  if (o.tier == Tier::nvme && o.nvme_paths.empty()) {
    fail(key + ".device = nvme requires " + key + ".nvme_path (one or more directories)");
  }
  for (size_t i = 0; i < o.nvme_paths.size(); ++i) {
    if (o.nvme_paths[i].empty()) fail(key + ".nvme_path[" + show(i) + "] is an empty path");
    // Each path holds one stripe file per tier; the same path twice would be the same file.
    for (size_t j = 0; j < i; ++j) {
      if (o.nvme_paths[j] == o.nvme_paths[i]) {
        fail(key + ".nvme_path[" + show(i) + "] = \"" + o.nvme_paths[i] + "\" repeats nvme_path[" +
             show(j) + "]");
      }
    }
  }
}

// Engines that run as on a GPU: the GPU itself, and the asynchronous CPU device that plays one
// (it takes the GPU's tiers and paths, so it takes the GPU's configurations only).
bool gpu_shaped(const Config& c) {
  return c.device == Device::cuda || c.async_device;
}
std::string gpu_setting(const Config& c) {
  return c.device == Device::cuda ? "zeroshard.device = cuda" : "zeroshard.async_device = true";
}

void check_loss_scale_and_optimizer(const Config& c) {
  const LossScaleOptions& ls = c.loss_scale;
  // A floor above the starting point would make the first overflow raise the scale.
  if (ls.static_scale == 0) {
    require(ls.window >= 1, "fp16.loss_scale_window", ls.window,
            "must be >= 1 with dynamic loss scaling (fp16.loss_scale = 0); 0 is only valid with "
            "a static fp16.loss_scale");
    require(std::ldexp(1.0, ls.initial_scale_power) >= ls.min_scale, "fp16.min_loss_scale",
            ls.min_scale,
            "is above the initial scale 2^" + show(ls.initial_scale_power) +
                " (fp16.initial_scale_power)");
  }
  // Loss scaling is f16's: on bf16 or f32 gradients a static scale would divide them by a
  // factor the trainer has no reason to have multiplied the loss by.
  if (ls.static_scale > 0 && c.dtype != DType::f16)
    fail("fp16.loss_scale = " + show(ls.static_scale) +
         " applies to f16 parameters only (dtype is " + dtype_name(c.dtype) +
         "); remove it, or set it to 0");
  const OptimizerOptions& o = c.optimizer;
  const bool sgd = o.kind == OptimizerKind::sgd;
  const bool muon = o.kind == OptimizerKind::muon;
  // Only SGD and Muon read momentum; silently ignoring it elsewhere would hide a
  // misconfiguration.
  require(
      o.momentum == 0 || sgd || muon, "optimizer.params.momentum", o.momentum,
      std::string("applies only to sgd and muon (optimizer is ") + optimizer_name(o.kind) + ")");
  if (muon) {
    require(o.momentum < 1, "optimizer.params.momentum", o.momentum,
            "must be in [0, 1) for muon (an exponential average)");
    if (c.stage == 3 && c.offload_param.tier == Tier::nvme &&
        c.offload_optimizer.tier != Tier::nvme)
      fail(
          "optimizer muon with zero_optimization.offload_param.device = nvme requires "
          "zero_optimization.offload_optimizer.device = nvme: with the optimizer state in memory "
          "the parameters' new shards are computed ahead of the update, which Muon's exchange "
          "does not support yet (docs/muon.md)");
    return;
  }
  if (o.nesterov && (!sgd || o.momentum <= 0)) {
    fail(std::string("optimizer.params.nesterov = true requires optimizer sgd with momentum > 0 "
                     "(optimizer is ") +
         optimizer_name(o.kind) + ", momentum = " + show(o.momentum) + ")");
  }
}

void check_tiers(const Config& c) {
  const OffloadOptions& opt = c.offload_optimizer;
  const OffloadOptions& par = c.offload_param;
  check_nvme_paths(opt, "zero_optimization.offload_optimizer");
  check_nvme_paths(par, "zero_optimization.offload_param");
  // Parameters are sharded only in stage 3; below it every rank holds them whole on the device.
  if (par.tier != Tier::device && c.stage != 3) {
    fail(std::string("zero_optimization.offload_param.device = ") +
         config_detail::deepspeed_tier_name(par.tier) +
         " requires zero_optimization.stage = 3 (stage is " + show(c.stage) +
         "): parameters are sharded, and so offloadable, only in stage 3");
  }
  // Stage 0 keeps the whole optimizer state on every rank: swapping it would only be slower.
  if (opt.tier == Tier::nvme && c.stage < 1) {
    fail(
        "zero_optimization.offload_optimizer.device = nvme requires zero_optimization.stage >= 1 "
        "(stage is 0: the optimizer state is not sharded)");
  }
  // The pipeline needs a slot to update in and one to read (or write) with.
  if (opt.tier == Tier::nvme) {
    require(opt.buffer_count >= 2, "zero_optimization.offload_optimizer.buffer_count",
            opt.buffer_count, "must be >= 2 for device nvme");
  }
  if (par.tier == Tier::nvme) {
    require(par.buffer_count >= 2, "zero_optimization.offload_param.buffer_count", par.buffer_count,
            "must be >= 2 for device nvme");
  }
  if (opt.tier == Tier::nvme && c.swap_read_ahead > 0) {
    require(c.swap_read_ahead < opt.buffer_count, "zeroshard.swap_read_ahead", c.swap_read_ahead,
            "must be below zero_optimization.offload_optimizer.buffer_count (" +
                show(opt.buffer_count) + ")");
  }
}

// A prefetch gathers the next unit into a free buffer while the current one is in use.
void check_prefetch(const Config& c) {
  if (c.prefetch && c.stage == 3 && c.max_live_units < 2)
    fail("zeroshard.max_live_units = " + show(c.max_live_units) +
         " leaves no buffer to prefetch into (the unit in use plus the one being prefetched): "
         "raise it to 2 or set zeroshard.prefetch = false");
}

// A bf16 master is the parameters' own precision, updated by the CPU kernels only.
void check_master(const Config& c) {
  if (!c.bf16_master) return;
  if (c.dtype != DType::bf16)
    fail(std::string("zeroshard.bf16_master = true requires bf16 parameters (bf16.enabled; dtype "
                     "is ") +
         dtype_name(c.dtype) + "): the low-precision copy is the master's own bits");
  if (gpu_shaped(c) && c.offload_optimizer.tier == Tier::device)
    fail("zeroshard.bf16_master = true with " + gpu_setting(c) +
         " requires zero_optimization.offload_optimizer.device cpu or nvme: the GPU update keeps "
         "an f32 master");
}

// What the GPU engine does not do: parameters off the GPU are updated where they live, by the
// CPU, so the optimizer must be there too (a GPU update would write host memory).
void check_cuda(const Config& c) {
  if (c.device == Device::cuda && c.async_device)
    fail(
        "zeroshard.async_device = true with zeroshard.device = cuda: the asynchronous device is "
        "the CPU device run as a GPU would run it (a testing device); use one or the other");
  if (!gpu_shaped(c)) return;
  const std::string gpu = gpu_setting(c);
  if (c.offload_param.tier != Tier::device && c.offload_optimizer.tier == Tier::device)
    fail(std::string("zero_optimization.offload_param.device = ") +
         config_detail::deepspeed_tier_name(c.offload_param.tier) + " with " + gpu +
         " requires zero_optimization.offload_optimizer.device cpu or nvme: the parameters off "
         "the GPU are updated by the CPU optimizer");
  if (c.offload_optimizer.tier == Tier::host && c.stage == 0)
    fail("zero_optimization.offload_optimizer.device = cpu with " + gpu +
         " requires zero_optimization.stage >= 1 (stage 0 keeps whole gradients on the GPU)");
  // The GPU update moves 8 elements per 16-byte access: every shard must start aligned. (The
  // asynchronous CPU device's kernels are the CPU's, which take any alignment.)
  if (c.device == Device::cuda)
    require(c.shard_alignment % 8 == 0, "zeroshard.shard_alignment", c.shard_alignment,
            "must be a multiple of 8 with zeroshard.device = cuda (vector accesses)");
}

}  // namespace

std::string config_detail::speculation_off(const Config& c, bool muon, bool gpu) {
  if (c.speculative_step == SpeculativeStep::off) return "not asked for";
  if (c.offload_optimizer.tier == Tier::device)
    return "the optimizer state is on the device tier (offload_optimizer.device cpu or nvme "
           "takes it)";
  if (c.stage == 3 && c.offload_param.tier == Tier::nvme)
    return "the parameters are on the nvme tier, which stores each new shard before the state "
           "may change";
  if (muon) return "a group is Muon, whose update exchanges matrices between ranks";
  if (c.speculative_step == SpeculativeStep::on) return "";
  // automatic: where a GPU runs backward, and the second copy costs no memory of the state's.
  if (!gpu)
    return "auto takes it on a GPU engine only (here backward runs on the CPU that would update "
           "beside it)";
  if (c.offload_optimizer.tier == Tier::host)
    return "auto leaves it off on the host tier, where it holds a second copy of the optimizer "
           "state in memory; set zeroshard.speculative_step = true to take it";
  return "";
}

bool config_detail::speculation_said(const Config& c, bool gpu) {
  return c.speculative_step == SpeculativeStep::on ||
         (c.speculative_step == SpeculativeStep::automatic && gpu &&
          c.offload_optimizer.tier != Tier::device);
}

void Config::validate() const {
  check_field_rules(*this);
  check_loss_scale_and_optimizer(*this);
  check_tiers(*this);
  check_prefetch(*this);
  check_cuda(*this);
  check_master(*this);
}

}  // namespace zeroshard
