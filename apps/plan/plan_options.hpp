#pragma once
// `zeroshard plan`'s options (plan_options.cpp): the model (a GPT's shape, a parameter count and
// largest unit, or a JSON file of units), the engine's settings, the memory per rank, and the
// rates a step is timed at (a calibration file, typed bandwidths, or both).

#include <cstdint>
#include <string>
#include <vector>

#include "apps/model/gpt.hpp"
#include "zeroshard/zeroshard.hpp"

namespace zsplan {

struct PlanOptions {
  // The model: a GPT (the demo's; GPT-2 small by default), or --params and --largest-unit, or
  // --units FILE.
  zsdemo::GptShape shape{50304, 1024, 768, 12, 12};
  int64_t total_params = 0, largest_unit = 0;
  std::string units_file;
  int ranks = 1;
  int shard_group = 0;  // Config::shard_group_size
  zeroshard::DType dtype = zeroshard::DType::bf16;
  zeroshard::OptimizerKind optimizer = zeroshard::OptimizerKind::adamw;
  zeroshard::StateFormat moments = zeroshard::StateFormat::f32;
  bool bf16_master = false;
  zeroshard::SpeculativeStep speculative = zeroshard::SpeculativeStep::automatic;  ///< flag
  zeroshard::Device device = zeroshard::Device::cpu;
  double device_gib = 0, host_gib = 0, nvme_gib = 0;  // per rank; 0 = not checked
  // The step's rates: from `calibration` and typed (a typed one over the file's).
  std::string calibration;
  double compute_s = 0;       // the trainer's forward + backward
  int ranks_per_node = 0;     // 0: one node
  double inter_node_gbs = 0;  // each node's link, GB/s
  std::string link_calibration;
  double memory_gbs = 0, disk_gbs = 0, bus_gbs = 0, pcie_gbs = 0, gpu_update_gps = 0;
  double ns_gflops = 0;  // Muon's Newton-Schulz iteration, GFLOP/s at every size
  bool timed = false;    // a calibration file or a typed rate: a step column
  zeroshard::MachineRates rates;
};

extern const char* const kPlanHelp;

/// The options of `args`; throws std::invalid_argument with the reason on bad usage (and on a
/// calibration file that cannot be read).
PlanOptions parse_plan(const std::vector<std::string>& args);

/// The engine's settings the plan is made for (stage and tiers vary per row).
zeroshard::Config plan_config(const PlanOptions& o);

/// The model's units (a parameter whose "decay" is false in group 1, which the plan gives no
/// weight decay; with --optimizer muon, the GPT's embeddings and head, and a units file's
/// parameters whose "muon" is false, in group 2), and a line naming the model. Throws
/// std::invalid_argument on a units file that cannot be read or is not a list of units.
std::vector<zeroshard::PlanUnit> plan_model(const PlanOptions& o, std::string& title);

}  // namespace zsplan
