// `zeroshard plan`'s options (plan_options.hpp).
#include "apps/plan/plan_options.hpp"

#include <cmath>
#include <cstdlib>
#include <fstream>
#include <initializer_list>
#include <nlohmann/json.hpp>
#include <stdexcept>

namespace zsplan {

using namespace zeroshard;

const char* const kPlanHelp =
    "usage: zeroshard plan [model] [--ranks N] [--dtype bf16|f16|f32]\n"
    "                      [--optimizer adamw|adam|lion|sgd|muon] [--optimizer-state "
    "f32|bf16|8bit]\n"
    "                      [--master f32|bf16] [--device cpu|cuda] [--shard-group N]\n"
    "                      [--speculative-step off|on|auto]\n"
    "                      [--device-gib X] [--host-gib X] [--nvme-gib X]\n"
    "                      [rates [--compute-s X] [--ranks-per-node N\n"
    "                              (--inter-node-gbs X | --link-calibration FILE)]]\n"
    "  model: [--layers N] [--dim N] [--heads N] [--vocab N] [--seq N]   a GPT (default)\n"
    "       | --params N --largest-unit N                  N parameters in units of at most\n"
    "                                                      the largest (k, M, G, T suffixes)\n"
    "       | --units FILE                                 a JSON list of units\n"
    "  rates: --calibration FILE, and or instead typed: [--memory-gbs X] [--disk-gbs X]\n"
    "         [--bus-gbs X] [--pcie-gbs X] [--gpu-update-gps X] [--ns-gflops X]\n\n"
    "For a model on --ranks ranks, prints for every ZeRO stage and offload choice the bytes one\n"
    "rank holds on each tier once the engine is finalized, computed by the engine's own setup\n"
    "with nothing allocated (what Engine::memory() will report; rank 0, or the largest rank\n"
    "where ranks differ), and whether they fit --device-gib, --host-gib and --nvme-gib per rank\n"
    "(0 or absent: not checked). The model is a GPT (the demo's: token and position embeddings,\n"
    "--layers blocks of width --dim, an untied head; default GPT-2 small); or --params\n"
    "parameters cut into units of --largest-unit (the last one smaller); or --units FILE, a JSON\n"
    "list of units as the trainer registers them:\n"
    "  [{\"name\": \"embed\", \"params\": [{\"name\": \"w\", \"shape\": [50304, 768]}]},\n"
    "   {\"name\": \"block0\", \"params\": [{\"name\": \"w\", \"shape\": [768, 2304]},\n"
    "                                  {\"name\": \"b\", \"shape\": [2304], \"decay\": false}]}]\n"
    "(\"decay\": false puts a parameter in a group without weight decay). With --optimizer muon\n"
    "the matrices are Muon's, and the vectors, the GPT's embeddings and head, and a units file's\n"
    "parameters with \"muon\": false are AdamW's, as the demo trains them. --device cuda plans\n"
    "GPU engines (one GPU per rank; the device tier is its memory), with their staging on the\n"
    "GPU and in pinned host memory, and only the choices a GPU engine takes.\n\n"
    "With rates, also the engine's step time per choice: the reductions and gathers the trainer\n"
    "waits for beyond --compute-s (its own forward and backward per step, default 0), the\n"
    "all-gather after the update, and the CPU update or the nvme tier's step; the trainer's\n"
    "compute is added as given, not predicted. --calibration is a file `zeroshard calibrate`\n"
    "wrote, under the same number of ranks per node. Typed rates stand in for what no file\n"
    "measured, or override it: --memory-gbs, a rank's memory bandwidth (the CPU update moves 28\n"
    "bytes per parameter with f32 moments, fewer with compact ones); --disk-gbs, a rank's share\n"
    "of its disks, reads and writes together (the nvme tier); --bus-gbs, the collectives' bus\n"
    "bandwidth as nccl-tests report it (a ring's reduce-scatter of S bytes over n ranks takes\n"
    "(n-1)/n S / bus); --ns-gflops, Muon's Newton-Schulz iteration on one rank's CPU, GFLOP/s.\n\n"
    "--shard-group N plans hierarchical sharding (Config::shard_group_size: shards within groups\n"
    "of N consecutive ranks, replicated across them). --ranks-per-node puts that many\n"
    "consecutive ranks on each node, and --inter-node-gbs is each node's link to the others\n"
    "(GB/s each way): collectives whose rings cross nodes take the bytes the busiest node sends\n"
    "over that link (the other rates stay for the collectives within a node); the 'MiB out'\n"
    "column is that node's bytes per step. --link-calibration instead takes the link's rate per\n"
    "collective from a calibration made with one rank on each node (mpirun --map-by node\n"
    "zeroshard calibrate): reduce-scatter, all-gather and all-reduce use a link at different\n"
    "rates.\n\n"
    "A GPU engine's step takes the GPU's rates from a file `zeroshard calibrate --device cuda`\n"
    "wrote, or typed: --pcie-gbs (pinned copies, GB/s each way), --gpu-update-gps (its update in\n"
    "GPU memory, G params/s). On more than one rank its collectives need --bus-gbs (a\n"
    "calibration's collectives are the host's), hidden behind the trainer's compute as far as it\n"
    "lasts (NCCL's own streams). A 'pcie s' column shows the host-GPU copies the step waits "
    "for.\n\n"
    "--speculative-step on plans Config::speculative_step: the host tier's rows hold a second\n"
    "copy of the optimizer state, and their update runs during backward (2/3 of --compute-s):\n"
    "'update s' is what is left of it after backward (docs/planner.md). auto (the default)\n"
    "takes it for a GPU engine's nvme rows only ('nvme s' is then what is left).\n";

namespace {

[[noreturn]] void bad(const std::string& why) {
  throw std::invalid_argument(why);
}

int64_t to_int(const std::string& flag, const std::string& v) {
  char* end = nullptr;
  const long long x = std::strtoll(v.c_str(), &end, 10);
  if (v.empty() || *end || x < 1) bad(flag + " needs a positive integer, got '" + v + "'");
  return x;
}

// A count with an optional decimal suffix: 7.5G, 70G, 1T, 512M.
int64_t to_count(const std::string& flag, const std::string& v) {
  char* end = nullptr;
  double x = std::strtod(v.c_str(), &end);
  const std::string suffix = end ? end : "";
  const double scale = suffix == "k"    ? 1e3
                       : suffix == "M"  ? 1e6
                       : suffix == "G"  ? 1e9
                       : suffix == "T"  ? 1e12
                       : suffix.empty() ? 1
                                        : 0;
  x *= scale;
  if (v.empty() || scale == 0 || !(x >= 1) || x > 9e18)
    bad(flag + " needs a positive count (k, M, G or T after it: 7.5G), got '" + v + "'");
  return int64_t(std::llround(x));
}

double to_number(const std::string& flag, const std::string& v, const char* what) {
  char* end = nullptr;
  const double x = std::strtod(v.c_str(), &end);
  if (v.empty() || *end || !(x >= 0)) bad(flag + " needs " + what + " >= 0, got '" + v + "'");
  return x;
}

// `field` = the value named `v` among `values`, else a usage error naming them.
template <class T>
void one_of(T& field, const std::string& f, const std::string& v,
            std::initializer_list<std::pair<const char*, T>> values) {
  std::string names;
  for (const auto& [name, value] : values) {
    if (v == name) return void(field = value);
    names += std::string(names.empty() ? "" : ", ") + name;
  }
  bad(f + " must be one of " + names + ", got '" + v + "'");
}

void parse_flag(PlanOptions& o, const std::string& f, const std::string& v) {
  if (f == "--layers")
    o.shape.layers = to_int(f, v);
  else if (f == "--dim")
    o.shape.dim = to_int(f, v);
  else if (f == "--heads")
    o.shape.heads = to_int(f, v);
  else if (f == "--vocab")
    o.shape.vocab = to_int(f, v);
  else if (f == "--seq")
    o.shape.seq = to_int(f, v);
  else if (f == "--params")
    o.total_params = to_count(f, v);
  else if (f == "--largest-unit")
    o.largest_unit = to_count(f, v);
  else if (f == "--units")
    o.units_file = v;
  else if (f == "--ranks")
    o.ranks = int(to_int(f, v));
  else if (f == "--shard-group")
    o.shard_group = int(to_int(f, v));
  else if (f == "--ranks-per-node")
    o.ranks_per_node = int(to_int(f, v));
  else if (f == "--inter-node-gbs")
    o.inter_node_gbs = to_number(f, v, "GB/s");
  else if (f == "--link-calibration")
    o.link_calibration = v;
  else if (f == "--device-gib")
    o.device_gib = to_number(f, v, "a size in GiB");
  else if (f == "--host-gib")
    o.host_gib = to_number(f, v, "a size in GiB");
  else if (f == "--nvme-gib")
    o.nvme_gib = to_number(f, v, "a size in GiB");
  else if (f == "--calibration")
    o.calibration = v;
  else if (f == "--compute-s")
    o.compute_s = to_number(f, v, "seconds");
  else if (f == "--memory-gbs")
    o.memory_gbs = to_number(f, v, "GB/s");
  else if (f == "--disk-gbs")
    o.disk_gbs = to_number(f, v, "GB/s");
  else if (f == "--bus-gbs")
    o.bus_gbs = to_number(f, v, "GB/s");
  else if (f == "--pcie-gbs")
    o.pcie_gbs = to_number(f, v, "GB/s");
  else if (f == "--gpu-update-gps")
    o.gpu_update_gps = to_number(f, v, "G params/s");
  else if (f == "--ns-gflops")
    o.ns_gflops = to_number(f, v, "GFLOP/s");
  else if (f == "--device")
    one_of<Device>(o.device, f, v, {{"cpu", Device::cpu}, {"cuda", Device::cuda}});
  else if (f == "--dtype")
    one_of<DType>(o.dtype, f, v, {{"bf16", DType::bf16}, {"f16", DType::f16}, {"f32", DType::f32}});
  else if (f == "--optimizer")
    one_of<OptimizerKind>(o.optimizer, f, v,
                          {{"adamw", OptimizerKind::adamw},
                           {"adam", OptimizerKind::adam},
                           {"lion", OptimizerKind::lion},
                           {"sgd", OptimizerKind::sgd},
                           {"muon", OptimizerKind::muon}});
  else if (f == "--optimizer-state")
    one_of<StateFormat>(
        o.moments, f, v,
        {{"f32", StateFormat::f32}, {"bf16", StateFormat::bf16}, {"8bit", StateFormat::q8}});
  else if (f == "--master")
    one_of<bool>(o.bf16_master, f, v, {{"f32", false}, {"bf16", true}});
  else if (f == "--speculative-step")
    one_of<SpeculativeStep>(o.speculative, f, v,
                            {{"off", SpeculativeStep::off},
                             {"on", SpeculativeStep::on},
                             {"auto", SpeculativeStep::automatic}});
  else
    bad("unknown flag " + f + " (zeroshard plan --help)");
}

// The rates the step is timed at: the file's, the typed ones over them.
void set_rates(PlanOptions& o) {
  MachineRates& r = o.rates;
  try {
    if (!o.calibration.empty()) r = read_calibration(o.calibration, plan_config(o));
    r.link = o.link_calibration.empty() ? LinkRates::uniform(o.inter_node_gbs)
                                        : read_link_calibration(o.link_calibration);
    set_typed_rates(
        r, plan_config(o), o.ranks,
        {o.memory_gbs, o.disk_gbs, o.bus_gbs, o.pcie_gbs, o.gpu_update_gps, o.ns_gflops});
  } catch (const Error& e) {
    bad(e.what());
  }
  r.compute_s = o.compute_s;
  r.ranks_per_node = o.ranks_per_node;
  if (o.device == Device::cuda && o.ranks > 1 && !(o.bus_gbs > 0))
    bad("--device cuda on " + std::to_string(o.ranks) +
        " ranks times the GPUs' collectives at --bus-gbs (their bus bandwidth, as nccl-tests "
        "report it): a calibration's collectives are the host's");
}

}  // namespace

PlanOptions parse_plan(const std::vector<std::string>& args) {
  PlanOptions o;
  bool gpt = false;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& f = args[i];
    if (i + 1 >= args.size()) bad(f + " needs a value (zeroshard plan --help)");
    parse_flag(o, f, args[++i]);
    gpt |= f == "--layers" || f == "--dim" || f == "--heads" || f == "--vocab" || f == "--seq";
  }
  const int models =
      int(gpt) + int(o.total_params > 0 || o.largest_unit > 0) + int(!o.units_file.empty());
  if (models > 1)
    bad("one model: a GPT's shape (--layers ...), --params with --largest-unit, or --units");
  if ((o.total_params > 0) != (o.largest_unit > 0)) bad("--params and --largest-unit go together");
  if (o.shape.dim % o.shape.heads != 0) bad("--dim is not a multiple of --heads");
  if (o.device == Device::cpu && (o.pcie_gbs > 0 || o.gpu_update_gps > 0))
    bad("--pcie-gbs and --gpu-update-gps are a GPU's: they need --device cuda");
  if (o.ns_gflops > 0 && o.optimizer != OptimizerKind::muon)
    bad("--ns-gflops is Muon's: it needs --optimizer muon");
  if (o.inter_node_gbs > 0 && !o.link_calibration.empty())
    bad("--inter-node-gbs and --link-calibration both give the link: one of them");
  o.timed = !o.calibration.empty() || o.memory_gbs > 0 || o.disk_gbs > 0 || o.bus_gbs > 0 ||
            o.pcie_gbs > 0 || o.gpu_update_gps > 0 || o.ns_gflops > 0;
  if (o.timed)
    set_rates(o);
  else if (o.compute_s > 0 || o.inter_node_gbs > 0 || !o.link_calibration.empty())
    bad("--compute-s, --inter-node-gbs and --link-calibration time the step: they need "
        "--calibration or a typed rate (--memory-gbs, --disk-gbs, --bus-gbs, ...)");
  return o;
}

Config plan_config(const PlanOptions& o) {
  Config cfg;
  cfg.dtype = o.dtype;
  cfg.optimizer.kind = o.optimizer;
  cfg.optimizer_state = o.moments;
  cfg.bf16_master = o.bf16_master;
  cfg.speculative_step = o.speculative;
  cfg.shard_group_size = o.shard_group;
  cfg.device = o.device;
  return cfg;
}

namespace {

std::vector<PlanUnit> units_from_file(const std::string& path, bool muon) {
  std::ifstream f(path);
  if (!f) bad("--units " + path + " cannot be read");
  std::vector<PlanUnit> units;
  size_t at = 0;
  try {
    const nlohmann::json j = nlohmann::json::parse(f);
    if (!j.is_array() || j.empty()) bad("--units " + path + ": not a non-empty list of units");
    for (; at < j.size(); ++at) {
      const nlohmann::json& u = j[at];
      PlanUnit pu{u.at("name").get<std::string>(), {}};
      for (const nlohmann::json& p : u.at("params")) {
        Param q{p.at("name").get<std::string>(), p.at("shape").get<std::vector<int64_t>>()};
        q.group = !p.value("decay", true) ? 1 : muon && !p.value("muon", true) ? 2 : 0;
        pu.params.push_back(std::move(q));
      }
      units.push_back(std::move(pu));
    }
  } catch (const nlohmann::json::exception& e) {
    bad("--units " + path + ": unit " + std::to_string(at) + ": " + e.what() +
        " (each unit: {\"name\": ..., \"params\": [{\"name\": ..., \"shape\": [...]}]})");
  }
  return units;
}

}  // namespace

std::vector<PlanUnit> plan_model(const PlanOptions& o, std::string& title) {
  std::vector<PlanUnit> units;
  if (!o.units_file.empty()) {
    units = units_from_file(o.units_file, o.optimizer == OptimizerKind::muon);
    title = o.units_file;
  } else if (o.total_params > 0) {
    for (int64_t left = o.total_params, i = 0; left > 0; left -= o.largest_unit, ++i)
      units.push_back({"unit" + std::to_string(i), {Param{"w", {std::min(left, o.largest_unit)}}}});
    title = "units of at most " + std::to_string(o.largest_unit) + " parameters";
  } else {
    for (const zsdemo::UnitSpec& u : zsdemo::gpt_units(o.shape)) {
      PlanUnit pu{u.name, {}};
      for (const zsdemo::ParamSpec& p : u.params)
        pu.params.push_back(
            Param{p.name, p.shape, zsdemo::gpt_group(u, p, o.optimizer == OptimizerKind::muon)});
      units.push_back(std::move(pu));
    }
    title = "GPT: " + std::to_string(o.shape.layers) + " blocks of width " +
            std::to_string(o.shape.dim) + ", vocab " + std::to_string(o.shape.vocab) +
            ", context " + std::to_string(o.shape.seq);
  }
  return units;
}

}  // namespace zsplan
