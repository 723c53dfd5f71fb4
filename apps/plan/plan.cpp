// `zeroshard plan` (plan.hpp). For the GPT the demo trains (any size), every ZeRO stage and
// offload choice on N ranks: the bytes one rank holds on each tier after finalize(), computed by
// the engine's own setup with nothing allocated (so the figures are what Engine::memory() will
// report), whether they fit the memory given per rank, and with a calibration file the engine's
// step time (predict_step()).
#include "apps/plan/plan.hpp"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <stdexcept>

#include "apps/cli/subcommand.hpp"
#include "apps/model/gpt.hpp"
#include "zeroshard/zeroshard.hpp"

namespace zsplan {

namespace {

using namespace zeroshard;

struct Options {
  zsdemo::GptShape shape{50304, 1024, 768, 12, 12};  // GPT-2 small by default
  int ranks = 1;
  int shard_group = 0;  // Config::shard_group_size
  DType dtype = DType::bf16;
  OptimizerKind optimizer = OptimizerKind::adamw;
  StateFormat moments = StateFormat::f32;
  bool bf16_master = false;
  double device_gib = 0, host_gib = 0, nvme_gib = 0;  // per rank; 0 = not checked
  std::string calibration;                            // empty: no step time
  double compute_s = 0;                               // the trainer's forward + backward
  int rates_per_node = 0;                             // ranks per node (0: one node)
  double inter_node_gbs = 0;                          // each node's link, GB/s
  std::string link_calibration;                       // or per collective, from this file
  Device device = Device::cpu;
  double pcie_gbs = 0, gpu_update_gps = 0, gpu_bus_gbs = 0;  // a GPU's, typed
  MachineRates rates;                                        // read from `calibration`
};

// The engine's settings the plan is made for (stage and tiers vary per row).
Config config(const Options& o) {
  Config cfg;
  cfg.dtype = o.dtype;
  cfg.optimizer.kind = o.optimizer;
  cfg.optimizer_state = o.moments;
  cfg.bf16_master = o.bf16_master;
  cfg.shard_group_size = o.shard_group;
  cfg.device = o.device;
  return cfg;
}

const char* kHelp =
    "usage: zeroshard plan [--layers N] [--dim N] [--heads N] [--vocab N] [--seq N] [--ranks N]\n"
    "                      [--dtype bf16|f16|f32] [--optimizer adamw|adam|lion|sgd]\n"
    "                      [--optimizer-state f32|bf16|8bit] [--master f32|bf16]\n"
    "                      [--device-gib X] [--host-gib X] [--nvme-gib X]\n"
    "                      [--calibration FILE [--compute-s X]]\n"
    "                      [--shard-group N] [--ranks-per-node N\n"
    "                       (--inter-node-gbs X | --link-calibration FILE)]\n"
    "                      [--device cpu|cuda [--pcie-gbs X] [--gpu-update-gps X]\n"
    "                       [--gpu-bus-gbs X]]\n\n"
    "For a GPT (the demo's model: token and position embeddings, --layers blocks of width --dim,\n"
    "an untied head; default GPT-2 small) on --ranks ranks, prints for every ZeRO stage and\n"
    "offload choice the bytes one rank holds on each tier once the engine is finalized, computed\n"
    "by the engine's own setup with nothing allocated (what Engine::memory() will report; rank 0,\n"
    "or the largest rank where shards differ), and whether they fit --device-gib, --host-gib and\n"
    "--nvme-gib per rank (0 or absent: not checked). --device cuda plans GPU engines (one GPU\n"
    "per rank; the device tier is its memory), with their staging on the GPU and in pinned host\n"
    "memory, and only the choices a GPU engine takes.\n\n"
    "With --calibration (a file `zeroshard calibrate` wrote, under the same number of ranks per\n"
    "node), also the engine's step time per choice: the reductions and gathers the trainer\n"
    "waits for beyond --compute-s (its own forward and backward per step, default 0), the\n"
    "all-gather after the update, and the CPU update or the nvme tier's step. The trainer's\n"
    "compute is added as given, not predicted.\n\n"
    "--shard-group N plans hierarchical sharding (Config::shard_group_size: shards within groups\n"
    "of N consecutive ranks, replicated across them). --ranks-per-node puts that many\n"
    "consecutive ranks on each node, and --inter-node-gbs is each node's link to the others\n"
    "(GB/s each way): collectives whose rings cross nodes take the bytes the busiest node sends\n"
    "over that link (the calibration's rates stay for the collectives within a node); the\n"
    "'MiB out' column is that node's bytes per step. --link-calibration instead takes the link's\n"
    "rate per collective from a calibration made with one rank on each node\n"
    "(mpirun --map-by node zeroshard calibrate): reduce-scatter, all-gather and all-reduce\n"
    "use a link at different rates.\n\n"
    "A GPU engine's step (--device cuda with --calibration) takes the GPU's rates from a file\n"
    "`zeroshard calibrate --device cuda` wrote, or typed: --pcie-gbs (pinned copies, GB/s each\n"
    "way), --gpu-update-gps (its update in GPU memory, G params/s). On more than one rank its\n"
    "collectives take --gpu-bus-gbs, the GPUs' bus bandwidth as nccl-tests report it (a ring's\n"
    "reduce-scatter of S bytes takes (n-1)/n S / bus), hidden behind the trainer's compute as far\n"
    "as it lasts (NCCL's own streams). A 'pcie s' column shows the host-GPU copies the step waits\n"
    "for.\n";

[[noreturn]] void bad(const std::string& why) {
  throw std::invalid_argument(why);
}

int64_t to_int(const std::string& flag, const std::string& v) {
  char* end = nullptr;
  const long long x = std::strtoll(v.c_str(), &end, 10);
  if (v.empty() || *end || x < 1) bad(flag + " needs a positive integer, got '" + v + "'");
  return x;
}

double to_number(const std::string& flag, const std::string& v, const char* what) {
  char* end = nullptr;
  const double x = std::strtod(v.c_str(), &end);
  if (v.empty() || *end || !(x >= 0)) bad(flag + " needs " + what + " >= 0, got '" + v + "'");
  return x;
}

double to_gib(const std::string& flag, const std::string& v) {
  return to_number(flag, v, "a size in GiB");
}

// A GPU engine's rates: the typed ones over the file's, and its collectives at the typed bus
// bandwidth (a calibration's are the host's).
void gpu_rates(Options& o) {
  MachineRates& r = o.rates;
  if (o.pcie_gbs > 0) r.h2d_gbs = r.d2h_gbs = o.pcie_gbs;
  if (o.gpu_update_gps > 0) r.gpu_update_params_per_s = o.gpu_update_gps * 1e9;
  r.comm_overlap = 1;  // the GPU's copies and collectives run beside its kernels
  if (o.ranks == 1) return;
  if (!(o.gpu_bus_gbs > 0))
    bad("--device cuda on " + std::to_string(o.ranks) +
        " ranks times the GPUs' collectives at --gpu-bus-gbs (their bus bandwidth, as "
        "nccl-tests report it): the calibration's collectives are the host's");
  try {
    set_bus_bandwidth(r, o.gpu_bus_gbs, o.ranks, o.shard_group);
  } catch (const Error& e) {
    bad(e.what());
  }
}

Options parse(const std::vector<std::string>& args) {
  Options o;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& f = args[i];
    if (i + 1 >= args.size()) bad(f + " needs a value (zeroshard plan --help)");
    const std::string& v = args[++i];
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
    else if (f == "--shard-group")
      o.shard_group = int(to_int(f, v));
    else if (f == "--ranks-per-node")
      o.rates_per_node = int(to_int(f, v));
    else if (f == "--inter-node-gbs")
      o.inter_node_gbs = to_number(f, v, "GB/s");
    else if (f == "--link-calibration")
      o.link_calibration = v;
    else if (f == "--ranks")
      o.ranks = int(to_int(f, v));
    else if (f == "--device-gib")
      o.device_gib = to_gib(f, v);
    else if (f == "--host-gib")
      o.host_gib = to_gib(f, v);
    else if (f == "--nvme-gib")
      o.nvme_gib = to_gib(f, v);
    else if (f == "--calibration")
      o.calibration = v;
    else if (f == "--compute-s")
      o.compute_s = to_number(f, v, "seconds");
    else if (f == "--pcie-gbs")
      o.pcie_gbs = to_number(f, v, "GB/s");
    else if (f == "--gpu-update-gps")
      o.gpu_update_gps = to_number(f, v, "G params/s");
    else if (f == "--gpu-bus-gbs")
      o.gpu_bus_gbs = to_number(f, v, "GB/s");
    else if (f == "--device") {
      if (v != "cpu" && v != "cuda") bad("--device must be cpu or cuda, got '" + v + "'");
      o.device = v == "cuda" ? Device::cuda : Device::cpu;
    }
    else if (f == "--dtype") {
      if (v == "bf16")
        o.dtype = DType::bf16;
      else if (v == "f16")
        o.dtype = DType::f16;
      else if (v == "f32")
        o.dtype = DType::f32;
      else
        bad("--dtype must be one of bf16, f16, f32, got '" + v + "'");
    } else if (f == "--optimizer") {
      bool found = false;
      for (OptimizerKind k :
           {OptimizerKind::adamw, OptimizerKind::adam, OptimizerKind::lion, OptimizerKind::sgd})
        if (v == optimizer_name(k)) o.optimizer = k, found = true;
      if (!found) bad("--optimizer must be one of adamw, adam, lion, sgd, got '" + v + "'");
    } else if (f == "--optimizer-state") {
      bool found = false;
      for (StateFormat s : {StateFormat::f32, StateFormat::bf16, StateFormat::q8})
        if (v == state_format_name(s)) o.moments = s, found = true;
      if (!found) bad("--optimizer-state must be one of f32, bf16, 8bit, got '" + v + "'");
    } else if (f == "--master") {
      if (v != "f32" && v != "bf16") bad("--master must be f32 or bf16, got '" + v + "'");
      o.bf16_master = v == "bf16";
    } else {
      bad("unknown flag " + f + " (zeroshard plan --help)");
    }
  }
  if (o.shape.dim % o.shape.heads != 0) bad("--dim is not a multiple of --heads");
  if (o.device == Device::cpu && (o.pcie_gbs > 0 || o.gpu_update_gps > 0 || o.gpu_bus_gbs > 0))
    bad("--pcie-gbs, --gpu-update-gps and --gpu-bus-gbs are a GPU's: they need --device cuda");
  if (!o.calibration.empty()) {
    if (o.inter_node_gbs > 0 && !o.link_calibration.empty())
      bad("--inter-node-gbs and --link-calibration both give the link: one of them");
    try {
      o.rates = read_calibration(o.calibration, config(o));
      o.rates.link = o.link_calibration.empty() ? LinkRates::uniform(o.inter_node_gbs)
                                                : read_link_calibration(o.link_calibration);
    } catch (const Error& e) {
      bad(e.what());
    }
    o.rates.compute_s = o.compute_s;
    o.rates.ranks_per_node = o.rates_per_node;
    if (o.device == Device::cuda) gpu_rates(o);
  } else if (o.compute_s > 0 || o.inter_node_gbs > 0 || !o.link_calibration.empty() ||
             o.pcie_gbs > 0 || o.gpu_update_gps > 0 || o.gpu_bus_gbs > 0) {
    bad("--compute-s, --inter-node-gbs, --link-calibration, --pcie-gbs, --gpu-update-gps and "
        "--gpu-bus-gbs time the step: they need --calibration");
  }
  return o;
}

double gib(int64_t b) {
  return double(b) / double(int64_t(1) << 30);
}

}  // namespace

int run_plan(const std::vector<std::string>& args) {
  Options o;
  if (const int rc = zscli::start_subcommand("plan", kHelp, args, parse, o); rc >= 0) return rc;
  std::vector<PlanUnit> units;
  int64_t params = 0;
  for (const zsdemo::UnitSpec& u : zsdemo::gpt_units(o.shape)) {
    PlanUnit pu{u.name, {}};
    for (const zsdemo::ParamSpec& p : u.params) {
      pu.params.push_back(Param{p.name, p.shape, p.decay ? 0 : 1});
      params += shape_numel(p.shape);
    }
    units.push_back(std::move(pu));
  }
  std::printf(
      "GPT: %lld blocks of width %lld, vocab %lld, context %lld: %.3f G parameters, %s, "
      "%s with %s moments and a%s master, %d rank(s)\n\n",
      (long long)o.shape.layers, (long long)o.shape.dim, (long long)o.shape.vocab,
      (long long)o.shape.seq, double(params) / 1e9, dtype_name(o.dtype),
      optimizer_name(o.optimizer), state_format_name(o.moments), o.bf16_master ? " bf16" : "n f32",
      o.ranks);
  const Config cfg = config(o);
  OptimizerOptions no_decay = cfg.optimizer;
  no_decay.weight_decay = 0;
  const bool timed = !o.calibration.empty();
  std::printf("%-5s %-9s %-9s %12s %12s %12s %14s  %-10s", "stage", "optimizer", "params",
              "device GiB", "host GiB", "nvme GiB", "model states", "fits");
  if (timed)
    std::printf(" %8s %8s %8s %8s %8s%s", "step s", "comm s", "update s", "nvme s", "MiB out",
                o.device == Device::cuda ? "   pcie s" : "");
  std::printf("\n");
  const double limit[kNumTiers] = {o.device_gib, o.host_gib, o.nvme_gib};
  for (const PlanChoice& c : plan_choices(cfg, units, o.ranks, {no_decay})) {
    std::string fits = limit[0] + limit[1] + limit[2] == 0 ? "-" : "yes";
    for (int t = kNumTiers - 1; t >= 0; --t)  // the first tier that overflows
      if (limit[t] > 0 && gib(c.tier_bytes[t]) > limit[t])
        fits = std::string("no (") + tier_name(Tier(t)) + ")";
    std::printf("%-5d %-9s %-9s %12.3f %12.3f %12.3f %14.3f  %-10s", c.stage,
                tier_name(c.optimizer), tier_name(c.params), gib(c.tier_bytes[0]),
                gib(c.tier_bytes[1]), gib(c.tier_bytes[2]), gib(c.model_states), fits.c_str());
    if (timed) {
      try {
        const StepPrediction p = predict_step(c.config, units, o.ranks, o.rates);
        std::printf(" %8.3f %8.3f %8.3f %8.3f %8.1f", p.total_s, p.comm_s, p.optimizer_s, p.nvme_s,
                    p.inter_node_bytes / double(1 << 20));
        if (o.device == Device::cuda) std::printf(" %8.3f", p.pcie_s);
      } catch (const Error& e) {  // a rate this row needs is not in the files: say which
        std::string why = e.what();
        const std::string prefix = "predict_step(): ";
        if (why.rfind(prefix, 0) == 0) why.erase(0, prefix.size());
        std::printf(" (%s)", why.c_str());
      }
    }
    std::printf("\n");
  }
  std::printf(
      "\nBytes per rank once finalized (parameters, gradients, master weights, optimizer state,\n"
      "gradient staging and gather buffers, swap staging and reserve); activations and the\n"
      "trainer's own memory come on top. \"model states\" is the ZeRO paper's part of it.\n");
  if (timed)
    std::printf(
        "Step: the engine's part (with --compute-s %.3f s of the trainer's compute added and\n"
        "hiding what it can), from %s.\n",
        o.compute_s, o.calibration.c_str());
  return 0;
}

}  // namespace zsplan
