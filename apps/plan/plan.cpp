// `zeroshard plan` (plan.hpp). For a model (the GPT the demo trains, any size; a parameter count
// in units; or the units of a JSON file), every ZeRO stage and offload choice on N ranks: the
// bytes one rank holds on each tier after finalize(), computed by the engine's own setup with
// nothing allocated (so the figures are what Engine::memory() will report), whether they fit the
// memory given per rank, and with a calibration file or typed rates the engine's step time
// (predict_step()). The options are plan_options.cpp's.
#include "apps/plan/plan.hpp"

#include <cstdio>

#include "apps/cli/subcommand.hpp"
#include "apps/plan/plan_options.hpp"
#include "zeroshard/zeroshard.hpp"

namespace zsplan {

namespace {

using namespace zeroshard;

double gib(int64_t b) {
  return double(b) / double(int64_t(1) << 30);
}

}  // namespace

int run_plan(const std::vector<std::string>& args) {
  PlanOptions o;
  if (const int rc = zscli::start_subcommand("plan", kPlanHelp, args, parse_plan, o); rc >= 0)
    return rc;
  std::string title;
  std::vector<PlanUnit> units;
  try {
    units = plan_model(o, title);
  } catch (const std::invalid_argument& e) {
    std::fprintf(stderr, "zeroshard plan: %s\n", e.what());
    return 2;
  }
  int64_t params = 0, largest = 0;
  for (const PlanUnit& u : units) {
    int64_t n = 0;
    for (const Param& p : u.params) n += shape_numel(p.shape);
    params += n;
    largest = std::max(largest, n);
  }
  std::printf(
      "%s: %.3f G parameters in %zu units (largest %.3f M), %s, %s with %s moments and a%s "
      "master, %d rank(s)%s\n\n",
      title.c_str(), double(params) / 1e9, units.size(), double(largest) / 1e6, dtype_name(o.dtype),
      optimizer_name(o.optimizer), state_format_name(o.moments), o.bf16_master ? " bf16" : "n f32",
      o.ranks, o.device == Device::cuda ? ", a GPU each" : "");
  const Config cfg = plan_config(o);
  // The demo's groups (the units' group numbers are gpt_group()'s; a learning rate plays no part).
  const std::vector<OptimizerOptions> groups = zsdemo::gpt_groups(cfg.optimizer, cfg.optimizer.lr);
  std::printf("%-5s %-9s %-9s %12s %12s %12s %14s  %-10s", "stage", "optimizer", "params",
              "device GiB", "host GiB", "nvme GiB", "model states", "fits");
  if (o.timed)
    std::printf(" %8s %8s %8s %8s %8s%s", "step s", "comm s", "update s", "nvme s", "MiB out",
                o.device == Device::cuda ? "   pcie s" : "");
  std::printf("\n");
  const double limit[kNumTiers] = {o.device_gib, o.host_gib, o.nvme_gib};
  std::vector<PlanChoice> choices;
  try {
    choices = plan_choices(cfg, units, o.ranks, groups);
  } catch (const Error& e) {  // settings the engine refuses
    std::fprintf(stderr, "zeroshard plan: %s\n", e.what());
    return 2;
  }
  for (const PlanChoice& c : choices) {
    std::string fits = limit[0] + limit[1] + limit[2] == 0 ? "-" : "yes";
    for (int t = kNumTiers - 1; t >= 0; --t)  // the first tier that overflows
      if (limit[t] > 0 && gib(c.tier_bytes[t]) > limit[t])
        fits = std::string("no (") + tier_name(Tier(t)) + ")";
    std::printf("%-5d %-9s %-9s %12.3f %12.3f %12.3f %14.3f  %-10s", c.stage,
                tier_name(c.optimizer), tier_name(c.params), gib(c.tier_bytes[0]),
                gib(c.tier_bytes[1]), gib(c.tier_bytes[2]), gib(c.model_states), fits.c_str());
    if (o.timed) {
      try {
        const StepPrediction p = predict_step(c.config, units, o.ranks, o.rates, groups);
        std::printf(" %8.3f %8.3f %8.3f %8.3f %8.1f", p.total_s, p.comm_s, p.optimizer_s, p.nvme_s,
                    p.inter_node_bytes / double(1 << 20));
        if (o.device == Device::cuda) std::printf(" %8.3f", p.pcie_s);
      } catch (const Error& e) {  // a rate this row needs is not given: say which
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
  if (o.timed)
    std::printf(
        "Step: the engine's part (with --compute-s %.3f s of the trainer's compute added and\n"
        "hiding what it can), from %s.%s\n",
        o.compute_s, o.calibration.empty() ? "the typed rates" : o.calibration.c_str(),
        o.optimizer == OptimizerKind::muon
            ? "\nWith Muon, \"update s\" includes the Newton-Schulz iteration of each unit's\n"
              "busiest owner, and \"comm s\" the exchange of its directions."
            : "");
  return 0;
}

}  // namespace zsplan
