// The planner's step time against the engine's, for one configuration (DESIGN.md rule 9: the
// prediction and the measurement in one run). Under mpirun -np W, an engine of --params
// parameters in --units equal units (stage, optimizer tier, stage 3's parameter tier and dtype
// as given; nvme state and parameters under --nvme-path) trains on synthetic gradients: per step,
// at stage 3 every unit gathered and released in forward order and again in backward order, every
// unit's gradient written and handed over in backward order, then step(). No model math: the
// trainer's compute is 0, so every collective is exposed, as predict_step() assumes with compute_s
// = 0. Rank 0 prints the median step time over --steps steps (after two warm-up steps), the slowest
// rank's, and predict_step()'s from --calibration, split as predicted. With --shard-group,
// hierarchical sharding; with --ranks-per-node and --inter-node-gbs (each node's link, GB/s) or
// --link-calibration (the link per collective kind, read_link_calibration()), the nodes
// predict_step() assumes; then it also prints the bytes the busiest node sent to other nodes
// per step (the engine's StepResult::inter_node_bytes, summed over the node's ranks) beside
// the prediction's.
//
//   mpirun -np 2 plan_step_bench --calibration cal.json --params 64M --units 16 --stage 2
//          --tier host [--param-tier device|host|nvme] [--dtype bf16] [--state f32|bf16|8bit]
//          [--steps 7] [--nvme-path DIR]
//          [--shard-group N] [--ranks-per-node N (--inter-node-gbs X | --link-calibration F)]
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <stdexcept>
#include <string>
#include <vector>

#include "benchmarks/io/parse_size.hpp"
#include "zeroshard/zeroshard.hpp"

using namespace zeroshard;

namespace {

double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  std::string calibration, tier = "host", dtype = "bf16", nvme_path, state = "f32", link_file,
                           param_tier = "device";
  int64_t params = int64_t(64) << 20;
  int units = 16, stage = 2, steps = 7, group = 0, per_node = 0;
  double link_gbs = 0;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i], v = argv[i + 1];
    if (k == "--calibration")
      calibration = v;
    else if (k == "--params")
      params = bench::parse_size(v);
    else if (k == "--units")
      units = std::stoi(v);
    else if (k == "--stage")
      stage = std::stoi(v);
    else if (k == "--tier")
      tier = v;
    else if (k == "--param-tier")
      param_tier = v;
    else if (k == "--dtype")
      dtype = v;
    else if (k == "--steps")
      steps = std::stoi(v);
    else if (k == "--nvme-path")
      nvme_path = v;
    else if (k == "--state")
      state = v;
    else if (k == "--shard-group")
      group = std::stoi(v);
    else if (k == "--ranks-per-node")
      per_node = std::stoi(v);
    else if (k == "--inter-node-gbs")
      link_gbs = std::stod(v);
    else if (k == "--link-calibration")
      link_file = v;
    else {
      std::fprintf(stderr, "plan_step_bench: unknown flag %s\n", k.c_str());
      return 2;
    }
  }
  try {
    std::shared_ptr<Communicator> comm = make_mpi_communicator();
    Config cfg;
    cfg.stage = stage;
    cfg.dtype = dtype == "f32" ? DType::f32 : DType::bf16;
    cfg.shard_group_size = group;
    cfg.offload_optimizer.tier = tier == "nvme"   ? Tier::nvme
                                 : tier == "host" ? Tier::host
                                                  : Tier::device;
    cfg.offload_param.tier = param_tier == "nvme"   ? Tier::nvme
                             : param_tier == "host" ? Tier::host
                                                    : Tier::device;
    if (!nvme_path.empty())
      cfg.offload_optimizer.nvme_paths = cfg.offload_param.nvme_paths = {nvme_path};
    // The moments' format, and "/bf16" for a bf16 master ("8bit/bf16").
    const std::string moments = state.substr(0, state.find('/'));
    cfg.optimizer_state = moments == "8bit"   ? StateFormat::q8
                          : moments == "bf16" ? StateFormat::bf16
                                              : StateFormat::f32;
    cfg.bf16_master = moments != state;
    if (moments != state_format_name(cfg.optimizer_state) ||
        (cfg.bf16_master && state != moments + "/bf16"))
      throw std::invalid_argument("--state: f32, bf16 or 8bit, optionally /bf16, not " + state);
    std::vector<PlanUnit> plan;
    Engine e(cfg, comm);
    for (int u = 0; u < units; ++u) {
      const Param p{"w", {params / units}};
      e.add_unit("u" + std::to_string(u), {p});
      plan.push_back({"u" + std::to_string(u), {p}});
    }
    e.finalize();
    std::vector<double> t, opt, exposed, inter;
    for (int s = 0; s < steps + 2; ++s) {
      comm->barrier("plan_step_bench");
      const double t0 = now();
      if (stage == 3)
        for (int pass = 0; pass < 2; ++pass)
          for (int i = 0; i < units; ++i) {
            const int u = pass == 0 ? i : units - 1 - i;
            e.gather(u);
            e.release(u);
          }
      for (int u = units - 1; u >= 0; --u) {
        for (const TensorView& g : e.grads(u)) {
          if (cfg.dtype == DType::f32)
            std::fill_n(static_cast<float*>(g.data), g.numel, 1e-3f);
          else
            std::fill_n(static_cast<uint16_t*>(g.data), g.numel, uint16_t(0x3a83));  // 1e-3
        }
        e.grads_ready(u);
      }
      const StepResult r = e.step();
      double dt = now() - t0;
      comm->all_reduce(&dt, 1, ReduceOp::max, "plan_step_bench")->wait();
      if (s >= 2) {  // the first steps touch the state and write the swap files
        t.push_back(dt);
        opt.push_back(r.optimizer_s);
        exposed.push_back(r.comm_exposed_s);
        inter.push_back(double(r.inter_node_bytes));
      }
    }
    // Each node's bytes to other nodes per step: its ranks' (median) counts summed.
    const int nodes_of = per_node > 0 ? per_node : comm->size();
    std::vector<double> node(size_t(comm->size() / nodes_of + 1), 0.0);
    node[size_t(comm->rank() / nodes_of)] = median(inter);
    comm->all_reduce(node.data(), int64_t(node.size()), ReduceOp::sum, "plan_step_bench")->wait();
    const double busiest = *std::max_element(node.begin(), node.end());
    if (comm->rank() == 0) {
      const double measured = median(t);
      std::printf(
          "stage %d tier %s param tier %s dtype %s state %s ranks %d params %lld units %d: "
          "measured %.4f s (rank 0: comm exposed %.4f, optimizer %.4f)",
          stage, tier.c_str(), param_tier.c_str(), dtype.c_str(), state.c_str(), comm->size(),
          (long long)params, units, measured, median(exposed), median(opt));
      if (!calibration.empty()) {
        MachineRates rates = read_calibration(calibration, cfg);
        rates.ranks_per_node = per_node;
        rates.link =
            link_file.empty() ? LinkRates::uniform(link_gbs) : read_link_calibration(link_file);
        const StepPrediction p = predict_step(cfg, plan, comm->size(), rates);
        std::printf(
            ", predicted %.4f s (comm %.4f, optimizer %.4f, nvme %.4f): predicted / measured "
            "%.3f",
            p.total_s, p.comm_s, p.optimizer_s, p.nvme_s, p.total_s / measured);
        if (per_node > 0)
          std::printf("; inter-node MiB per step: engine %.2f, predicted %.2f",
                      busiest / double(1 << 20), p.inter_node_bytes / double(1 << 20));
      }
      std::printf("\n");
    }
    return 0;
  } catch (const std::exception& ex) {
    std::fprintf(stderr, "plan_step_bench: %s\n", ex.what());
    return 1;
  }
}
