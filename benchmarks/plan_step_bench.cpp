// The planner's step time against the engine's, for one configuration (docs/DESIGN.md rule 9: the
// prediction and the measurement in one run). Under mpirun -np W, an engine of --params
// parameters in --units equal units (stage, optimizer tier, stage 3's parameter tier and dtype
// as given; nvme state and parameters under --nvme-path) trains on synthetic gradients: per step,
// at stage 3 every unit gathered and released in forward order and again in backward order, every
// unit's gradient written and handed over in backward order, then step(). No model math: the
// trainer's compute is the writing of the gradients, timed alone (the slowest rank's median of
// writes of every unit's gradients, with no hand-over) and given to predict_step() as compute_s,
// with the calibration's comm_overlap saying how much of it the reductions can hide behind.
// Rank 0 prints the median step time over --steps steps (after two warm-up steps), the slowest
// rank's, and predict_step()'s from --calibration, split as predicted. With --shard-group,
// hierarchical sharding; with --ranks-per-node and --inter-node-gbs (each node's link, GB/s) or
// --link-calibration (the link per collective kind, read_link_calibration()), the nodes
// predict_step() assumes; then it also prints the bytes the busiest node sent to other nodes
// per step (the engine's StepResult::inter_node_bytes, summed over the node's ranks) beside
// the prediction's.
//
// With --alternate R (flat sharding on one node), the run alternates R rounds of --steps steps
// with a measurement of the step's own collectives (reduce-scatter, all-gather and all-reduce of
// one shard's bytes, on a reused buffer, on fresh ones, and many at once, as `zeroshard
// calibrate` measures them) in the same process, and predicts each round from the collectives
// measured beside it (the CPU update and nvme rates still from --calibration). It prints each
// round's ratio and their median: the model checked against the rates the step ran at, on a machine
// whose collectives change speed from one minute to the next.
//
//   mpirun -np 2 plan_step_bench --calibration cal.json --params 64M --units 16 --stage 2
//          --tier host [--param-tier device|host|nvme] [--dtype bf16] [--state f32|bf16|8bit]
//          [--steps 7] [--nvme-path DIR]
//          [--shard-group N] [--ranks-per-node N (--inter-node-gbs X | --link-calibration F)]
//          [--alternate R] [--device cuda]
//
// With --device cuda (one rank, GPU 0, over one-rank NCCL; the state and stage 3's parameters on
// the tiers given), the gradients are not written (the engine's own, on the GPU, as it leaves
// them: the update does the same work on any values) and there is no trainer compute; the
// prediction takes the calibration's gpu section (`zeroshard calibrate --device cuda`) and
// shows the host-GPU copies. The one-rank collectives' copies on the GPU are not predicted.
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

// The slowest rank's median of `reps` timed calls of `op(i)` (after one untimed), each between
// barriers.
template <class Op>
double timed(Communicator& comm, int reps, Op op) {
  std::vector<double> t;
  for (int r = 0; r <= reps; ++r) {
    comm.barrier("plan_step_bench");
    const double t0 = now();
    op(r);
    if (r > 0) t.push_back(now() - t0);
  }
  double m = median(t);
  comm.all_reduce(&m, 1, ReduceOp::max, "plan_step_bench")->wait();
  return m;
}

// The step's collectives of one shard of `bytes` (per rank, elements of `dt`), as `zeroshard
// calibrate` measures them (time_collectives()). Returns `rates` with these as its only points.
MachineRates measured_beside(Communicator& comm, MachineRates rates, int64_t bytes, DType dt) {
  const CollectiveTimes t = time_collectives(comm, bytes, dt, 5);
  const double b = double(bytes);
  CollectiveRate* kinds[3] = {&rates.reduce_scatter, &rates.all_gather, &rates.all_reduce};
  for (int c = 0; c < 3; ++c) {
    kinds[c]->warm = {{b, t.warm[c]}};
    kinds[c]->cold = {{b, t.cold[c]}};
    kinds[c]->queued.clear();
    if (c < 2) kinds[c]->queued = {{b, t.queued[c]}};
  }
  return rates;
}

}  // namespace

int main(int argc, char** argv) {
  std::string calibration, tier = "host", dtype = "bf16", nvme_path, state = "f32", link_file,
                           param_tier = "device", device = "cpu";
  int64_t params = int64_t(64) << 20;
  int units = 16, stage = 2, steps = 7, group = 0, per_node = 0, alternate = 0;
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
    else if (k == "--alternate")
      alternate = std::stoi(v);
    else if (k == "--device")
      device = v;
    else {
      std::fprintf(stderr, "plan_step_bench: unknown flag %s\n", k.c_str());
      return 2;
    }
  }
  try {
    const std::shared_ptr<Communicator> mpi = make_mpi_communicator();  // lives to the end
    std::shared_ptr<Communicator> comm = mpi;
    const bool gpu = device == "cuda";
    if (device != "cpu" && !gpu)
      throw std::invalid_argument("--device: cpu or cuda, not " + device);
    if (gpu && (comm->size() > 1 || alternate > 0))
      throw std::invalid_argument("--device cuda: one rank (its GPU), without --alternate");
    Config cfg;
    cfg.stage = stage;
    if (gpu) {  // the GPU over one-rank NCCL: its collectives stay on the GPU, as on many GPUs
      cfg.device = Device::cuda;
      cfg.device_index = 0;
      comm = make_nccl_communicator(0);
    }
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
    if (alternate > 0 && (calibration.empty() || group > 0 || per_node > 0))
      throw std::invalid_argument(
          "--alternate needs --calibration, and flat sharding on one node (no --shard-group, "
          "--ranks-per-node)");
    std::vector<double> t, opt, exposed, busy, inter;
    auto write_grads = [&](int u) {
      if (gpu) return (void)e.grads(u);  // GPU memory: the engine's values stay
      for (const TensorView& g : e.grads(u)) {
        if (cfg.dtype == DType::f32)
          std::fill_n(static_cast<float*>(g.data), g.numel, 1e-3f);
        else
          std::fill_n(static_cast<uint16_t*>(g.data), g.numel, uint16_t(0x3a83));  // 1e-3
      }
    };
    // The trainer's compute: every unit's gradients written, without the hand-over (the slowest
    // rank's median of 5), into buffers as the engine's: one per unit at stages 0-1 (its whole
    // gradient buffers), two used in turn at stages 2-3 (its staging slots, which grads() hands
    // out only once the one before was handed over).
    std::vector<std::vector<uint32_t>> alone(size_t(stage <= 1 ? units : 2));
    for (std::vector<uint32_t>& b : alone)
      b.assign(size_t((params / units * int64_t(dtype_size(cfg.dtype)) + 3) / 4), 0);
    auto compute_s = [&] {
      if (gpu) return 0.0;  // nothing written
      return timed(*comm, 5, [&](int) {
        for (int u = units - 1; u >= 0; --u) {
          std::vector<uint32_t>& b = alone[size_t(u) % alone.size()];
          std::fill(b.begin(), b.end(), 0x3a833a83u);  // 1e-3 in bf16, twice; a finite f32
        }
      });
    };
    // `count` steps, each timed (the slowest rank's) and, with `keep`, recorded.
    auto run_steps = [&](int count, bool keep) {
      for (int s = 0; s < count; ++s) {
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
          write_grads(u);
          e.grads_ready(u);
        }
        const StepResult r = e.step();
        double dt = now() - t0;
        comm->all_reduce(&dt, 1, ReduceOp::max, "plan_step_bench")->wait();
        if (keep) {
          t.push_back(dt);
          opt.push_back(r.optimizer_s);
          exposed.push_back(r.comm_exposed_s);
          busy.push_back(r.comm_busy_s);
          inter.push_back(double(r.inter_node_bytes));
        }
      }
    };
    run_steps(2, false);  // the first steps touch the state and write the swap files
    if (alternate > 0) {
      const MachineRates file = read_calibration(calibration, cfg);
      const int64_t shard_bytes = e.shard_info(0).shard_numel * int64_t(dtype_size(cfg.dtype));
      std::vector<double> ratio, measured, rs;
      std::vector<StepPrediction> predicted;
      for (int round = 0; round < alternate; ++round) {
        t.clear();
        run_steps(steps, true);
        MachineRates rates = measured_beside(*comm, file, shard_bytes, cfg.dtype);
        rates.compute_s = compute_s();
        predicted.push_back(predict_step(cfg, plan, comm->size(), rates));
        const StepPrediction& p = predicted.back();
        measured.push_back(median(t));
        ratio.push_back(p.total_s / measured.back());
        rs.push_back(rates.reduce_scatter.warm[0].second);
        if (comm->rank() == 0)
          std::printf(
              "round %d: measured %.4f s, predicted %.4f s (compute %.4f, comm %.4f, optimizer "
              "%.4f, nvme %.4f; a warm reduce-scatter of one shard %.2f ms): %.3f\n",
              round, measured.back(), p.total_s, p.compute_s, p.comm_s, p.optimizer_s, p.nvme_s,
              rs.back() * 1e3, ratio.back());
      }
      // The round whose ratio is the median, in the line plan_vs_measured.sh reads; its drift:
      // how far the warm reduce-scatter's time moved over the rounds (largest / smallest - 1).
      std::vector<size_t> order(ratio.size());
      for (size_t i = 0; i < order.size(); ++i) order[i] = i;
      std::sort(order.begin(), order.end(),
                [&](size_t a, size_t b) { return ratio[a] < ratio[b]; });
      const size_t mid = order[order.size() / 2];
      const StepPrediction& p = predicted[mid];
      const double drift =
          *std::max_element(rs.begin(), rs.end()) / *std::min_element(rs.begin(), rs.end()) - 1;
      if (comm->rank() == 0)
        std::printf(
            "stage %d tier %s param tier %s dtype %s state %s ranks %d params %lld units %d: "
            "measured %.4f s, predicted %.4f s (compute %.4f, comm %.4f, optimizer %.4f, nvme "
            "%.4f): predicted / measured %.3f (median of %d alternated rounds), drift %.2f\n",
            stage, tier.c_str(), param_tier.c_str(), dtype.c_str(), state.c_str(), comm->size(),
            (long long)params, units, measured[mid], p.total_s, p.compute_s, p.comm_s,
            p.optimizer_s, p.nvme_s, ratio[mid], alternate, drift);
      return 0;
    }
    run_steps(steps, true);
    const double compute = compute_s();
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
          "measured %.4f s (rank 0: comm exposed %.4f of %.4f busy, optimizer %.4f)",
          stage, tier.c_str(), param_tier.c_str(), dtype.c_str(), state.c_str(), comm->size(),
          (long long)params, units, measured, median(exposed), median(busy), median(opt));
      if (!calibration.empty()) {
        MachineRates rates = read_calibration(calibration, cfg);
        rates.compute_s = compute;
        rates.ranks_per_node = per_node;
        rates.link =
            link_file.empty() ? LinkRates::uniform(link_gbs) : read_link_calibration(link_file);
        const StepPrediction p = predict_step(cfg, plan, comm->size(), rates);
        std::printf(
            ", predicted %.4f s (compute %.4f, comm %.4f, optimizer %.4f, pcie %.4f, nvme %.4f): "
            "predicted / measured %.3f",
            p.total_s, p.compute_s, p.comm_s, p.optimizer_s, p.pcie_s, p.nvme_s,
            p.total_s / measured);
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
