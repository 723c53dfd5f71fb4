// predict_step() and read_calibration() (zeroshard/planner.hpp): the step-time half of the
// planner. Per unit, the engine's own layout (plan_unit()) gives the bytes each collective moves
// and the elements this rank updates; the machine's rates turn them into seconds.
#include <algorithm>
#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>

#include "base/check.hpp"
#include "base/layout.hpp"
#include "kernels/cpu/cpu_kernels.hpp"
#include "kernels/cpu/newton_schulz.hpp"
#include "src/config/internal.hpp"
#include "src/muon_exchange.hpp"
#include "zeroshard/planner.hpp"

namespace zeroshard {

double CollectiveRate::seconds(double bytes, Buffers buffers) const {
  if (!(bandwidth_gbs > 0))
    ZS_THROW(invalid_argument,
             "predict_step(): a collective's bandwidth is not measured (zeroshard calibrate "
             "measures it over its ranks; zeroshard plan takes it typed as --bus-gbs)");
  // A kind not measured takes the next: queued, then cold, then warm.
  const std::vector<std::pair<double, double>>* pts = &warm;
  if (buffers == Buffers::queued && !queued.empty())
    pts = &queued;
  else if (buffers != Buffers::warm && !cold.empty())
    pts = &cold;
  const std::vector<std::pair<double, double>>& points = *pts;
  if (points.empty()) return latency_s + bytes / (bandwidth_gbs * 1e9);
  if (bytes <= points.front().first) return points.front().second;
  for (size_t i = 1; i < points.size(); ++i) {
    const auto [b0, t0] = points[i - 1];
    const auto [b1, t1] = points[i];
    if (bytes <= b1) return t0 + (t1 - t0) * (bytes - b0) / (b1 - b0);
  }
  return points.back().second + (bytes - points.back().first) / (bandwidth_gbs * 1e9);
}

namespace {

// A collective's measured (bytes, seconds), in increasing size.
std::vector<std::pair<double, double>> points(const nlohmann::json& c, const std::string& path,
                                              const char* name) {
  std::vector<std::pair<double, double>> p;
  for (const nlohmann::json& pt : c.at("points_bytes_s"))
    p.emplace_back(pt.at(0).get<double>(), pt.at(1).get<double>());
  for (size_t i = 1; i < p.size(); ++i)
    if (!(p[i].first > p[i - 1].first))
      ZS_THROW(invalid_argument, "calibration file " << path << ": collectives." << name
                                                     << ": measured sizes must increase");
  return p;
}

// The hops to another node the busiest node sends when every ring of `rings` (all `world`
// ranks, each ring in ring order) runs at once, each rank sending to the next; nodes are
// `per_node` consecutive ranks. A collective's bytes over the links are this × its hop.
int busiest_node_hops(const std::vector<std::vector<int>>& rings, int world, int per_node) {
  std::vector<int> out(size_t((world + per_node - 1) / per_node), 0);
  for (const std::vector<int>& ring : rings)
    for (size_t i = 0; i < ring.size(); ++i) {
      const int from = ring[i], to = ring[(i + 1) % ring.size()];
      if (from / per_node != to / per_node) ++out[size_t(from / per_node)];
    }
  return *std::max_element(out.begin(), out.end());
}

}  // namespace

std::string calibration_format(const Config& cfg) {
  return std::string(state_format_name(cfg.optimizer_state)) + (cfg.bf16_master ? "/bf16" : "");
}

MachineRates read_calibration(const std::string& path, const Config& cfg) {
  using nlohmann::json;
  std::ifstream f(path);
  if (!f) ZS_THROW(invalid_argument, "calibration file " << path << " cannot be read");
  const char* at = "";
  try {
    const json j = json::parse(f);
    at = "schema";
    if (j.at("schema").get<std::string>() != "zeroshard-calibration/1")
      ZS_THROW(invalid_argument, "calibration file " << path << " has schema "
                                                     << j.at("schema").dump()
                                                     << ", not zeroshard-calibration/1");
    MachineRates r;
    at = "optimizer.adamw.<dtype>.params_per_s";
    const char* d = cfg.dtype == DType::f32 ? "f32" : "bf16";  // f16 moves bf16's bytes
    const json& adamw = j.at("optimizer").at("adamw").at(d);
    // f32 moments and master at the top, other formats under state_formats (absent: not
    // measured).
    const std::string fmt = calibration_format(cfg);
    auto measured = [&](const json& where, const char* key) {
      if (fmt == "f32") return where.at(key).get<double>();
      if (!where.contains("state_formats") || !where.at("state_formats").contains(fmt)) return 0.0;
      return where.at("state_formats").at(fmt).at(key).get<double>();
    };
    r.update_params_per_s = measured(adamw, "params_per_s");
    at = "newton_schulz.points_madds_per_s";  // absent in files from before it was measured
    if (j.contains("newton_schulz"))
      for (const json& p : j.at("newton_schulz").at("points_madds_per_s"))
        r.newton_schulz.push_back({p.at(0).get<double>(), p.at(1).get<double>()});
    at = "collectives";
    const json& c = j.at("collectives");
    for (auto [name, rate] :
         {std::pair{"reduce_scatter", &r.reduce_scatter}, std::pair{"all_gather", &r.all_gather},
          std::pair{"all_reduce", &r.all_reduce}})
      if (c.contains(name)) {
        rate->latency_s = c.at(name).at("latency_s").get<double>();
        rate->bandwidth_gbs = c.at(name).at("bandwidth_gbs").get<double>();
        rate->warm = points(c.at(name), path, name);
        // Absent in files from before they were measured (and "queued" for the all-reduce).
        for (auto [key, to] : {std::pair{"cold", &rate->cold}, std::pair{"queued", &rate->queued}})
          if (c.at(name).contains(key)) *to = points(c.at(name).at(key), path, name);
      }
    at = "collectives.overlap";  // absent in files from before it was measured: full overlap
    if (c.contains("overlap")) {
      r.comm_overlap = c.at("overlap").get<double>();
      if (!(r.comm_overlap >= 0 && r.comm_overlap <= 1))
        ZS_THROW(invalid_argument, "calibration file " << path << ": collectives.overlap = "
                                                       << r.comm_overlap << ", not in [0, 1]");
    }
    at = "nvme.step_params_per_s";
    if (j.contains("nvme") && !j.at("nvme").is_null()) {
      r.nvme_step_params_per_s = measured(j.at("nvme"), "step_params_per_s");
      at = "nvme.param_tier";  // absent in files from before it was measured
      if (j.at("nvme").contains("param_tier")) {
        r.param_read_gbs = j.at("nvme").at("param_tier").at("read_gbs").get<double>();
        r.param_write_gbs = j.at("nvme").at("param_tier").at("write_gbs").get<double>();
        r.param_write_with_records_gbs =
            j.at("nvme").at("param_tier").at("write_with_records_gbs").get<double>();
      }
    }
    at = "gpu";  // absent or null: a calibration without --device cuda
    if (j.contains("gpu") && !j.at("gpu").is_null()) {
      const json& g = j.at("gpu");
      at = "gpu.h2d_gbs";
      r.h2d_gbs = g.at("h2d_gbs").get<double>();
      at = "gpu.d2h_gbs";
      r.d2h_gbs = g.at("d2h_gbs").get<double>();
      at = "gpu.adamw.<dtype>.params_per_s";
      r.gpu_update_params_per_s = measured(g.at("adamw").at(d), "params_per_s");
    }
    return r;
  } catch (const json::exception& e) {
    ZS_THROW(invalid_argument, "calibration file " << path << ": " << at << ": " << e.what());
  }
}

LinkRates read_link_calibration(const std::string& path) {
  Config any;
  const MachineRates m = read_calibration(path, any);
  int n = 0;
  try {
    std::ifstream f(path);
    n = nlohmann::json::parse(f).at("collectives").at("world").get<int>();
  } catch (const nlohmann::json::exception& e) {
    ZS_THROW(invalid_argument, "calibration file " << path << ": collectives.world: " << e.what());
  }
  if (n < 2)
    ZS_THROW(invalid_argument, "calibration file "
                                   << path << " was made on " << n
                                   << " rank: a link between nodes needs one rank on each of "
                                      "two or more (mpirun --map-by node zeroshard calibrate)");
  for (auto [c, name] :
       {std::pair{&m.reduce_scatter, "reduce_scatter"}, std::pair{&m.all_gather, "all_gather"},
        std::pair{&m.all_reduce, "all_reduce"}})
    if (!(c->bandwidth_gbs > 0))
      ZS_THROW(invalid_argument,
               "calibration file " << path << ": collectives." << name << " is not measured");
  LinkRates l{n, m.reduce_scatter, m.all_gather, m.all_reduce};
  for (CollectiveRate* c : {&l.reduce_scatter, &l.all_gather, &l.all_reduce}) {
    c->cold.clear();
    c->queued.clear();
  }
  return l;
}

double record_bytes_per_param(const Config& cfg) {
  const double master = cfg.bf16_master ? 2 : 4;
  return master + cpu::num_states(cfg.optimizer.kind, cfg.optimizer.momentum != 0) *
                      double(cpu::state_bytes(cfg.optimizer_state));
}

double update_bytes_per_param(const Config& cfg) {
  const double p = double(dtype_size(cfg.dtype));
  const bool copy = cfg.dtype != DType::f32;  // an f32 model's master is its parameter
  return 2 * record_bytes_per_param(cfg) + p + (copy ? p : 0);
}

void set_typed_rates(MachineRates& r, const Config& cfg, int world, const TypedRates& t) {
  for (double x : {t.memory_gbs, t.disk_gbs, t.bus_gbs, t.pcie_gbs, t.gpu_update_gps, t.ns_gflops})
    if (!(x >= 0)) ZS_THROW(invalid_argument, "set_typed_rates(): a rate of " << x);
  if (t.memory_gbs > 0) r.update_params_per_s = t.memory_gbs * 1e9 / update_bytes_per_param(cfg);
  if (t.disk_gbs > 0) {
    r.nvme_step_params_per_s = t.disk_gbs * 1e9 / (2 * record_bytes_per_param(cfg));
    r.param_read_gbs = r.param_write_gbs = r.param_write_with_records_gbs = t.disk_gbs;
  }
  if (t.bus_gbs > 0) set_bus_bandwidth(r, t.bus_gbs, world, cfg.shard_group_size);
  if (t.ns_gflops > 0) r.newton_schulz = {{1.0, t.ns_gflops * 1e9 / 2}};  // 2 flops a multiply-add
  if (cfg.device == Device::cpu) return;
  if (t.pcie_gbs > 0) r.h2d_gbs = r.d2h_gbs = t.pcie_gbs;
  if (t.gpu_update_gps > 0) r.gpu_update_params_per_s = t.gpu_update_gps * 1e9;
  r.comm_overlap = 1;
}

void set_bus_bandwidth(MachineRates& r, double bus_gbs, int world, int group) {
  if (group == 0) group = world;
  if (!(bus_gbs > 0) || world < 1 || group < 1 || world % group != 0)
    ZS_THROW(invalid_argument, "set_bus_bandwidth(): " << bus_gbs << " GB/s, groups of " << group
                                                       << " in " << world << " ranks");
  const int replicas = world / group;
  r.reduce_scatter = r.all_gather = {0, group > 1 ? bus_gbs / (group - 1) : bus_gbs, {}, {}, {}};
  r.all_reduce = {
      0, replicas > 1 ? bus_gbs * replicas / (2.0 * (replicas - 1)) : bus_gbs, {}, {}, {}};
}

// Seconds of Muon's iteration on a matrix of `madds` multiply-adds at the rates measured (see
// MachineRates::newton_schulz): interpolated on a log scale between points, the nearest outside.
double newton_schulz_seconds(const std::vector<std::pair<double, double>>& pts, double madds) {
  if (madds <= pts.front().first) return madds / pts.front().second;
  if (madds >= pts.back().first) return madds / pts.back().second;
  size_t i = 1;
  while (pts[i].first < madds) ++i;
  const auto [x0, r0] = pts[i - 1];
  const auto [x1, r1] = pts[i];
  const double t = std::log(madds / x0) / std::log(x1 / x0);
  return madds / std::exp(std::log(r0) + t * std::log(r1 / r0));
}

StepPrediction predict_step(const Config& cfg, const std::vector<PlanUnit>& units, int world,
                            const MachineRates& rates,
                            const std::vector<OptimizerOptions>& groups) {
  if (world < 1) ZS_THROW(invalid_argument, "predict_step(): world " << world);
  {  // a choice the engine refuses (a GPU engine's) has no step; a prediction needs no disk
    Config c = cfg;
    for (OffloadOptions* o : {&c.offload_optimizer, &c.offload_param})
      if (o->nvme_paths.empty()) o->nvme_paths = {"nvme"};
    c.validate();
  }
  const bool gpu = cfg.device == Device::cuda;
  const bool nvme = cfg.offload_optimizer.tier == Tier::nvme;
  const bool params_off = cfg.stage == 3 && cfg.offload_param.tier != Tier::device;
  const bool nvme_params = params_off && cfg.offload_param.tier == Tier::nvme;
  // A GPU engine with its optimizer off the GPU downloads the reduced gradients and (parameters
  // on the GPU) uploads the new parameters; with stage 3's shards off it, uploads each before
  // its gather.
  const bool gpu_state_off = gpu && cfg.offload_optimizer.tier != Tier::device;
  const bool gpu_update = gpu && !gpu_state_off;
  const double write_gbs = nvme ? rates.param_write_with_records_gbs : rates.param_write_gbs;
  if (nvme_params && !(rates.param_read_gbs > 0 && write_gbs > 0))
    ZS_THROW(invalid_argument,
             "predict_step(): the nvme parameter tier's read and write rates "
             "are not measured (zeroshard calibrate --nvme-path DIR measures "
             "them; zeroshard plan takes them typed as --disk-gbs)");
  const double update_rate = nvme         ? rates.nvme_step_params_per_s
                             : gpu_update ? rates.gpu_update_params_per_s
                                          : rates.update_params_per_s;
  if (!(update_rate > 0))
    ZS_THROW(invalid_argument, "predict_step(): the "
                                   << (nvme         ? "nvme step"
                                       : gpu_update ? "GPU update"
                                                    : "CPU update")
                                   << " rate with " << state_format_name(cfg.optimizer_state)
                                   << " moments" << (cfg.bf16_master ? " and a bf16 master" : "")
                                   << " is not measured (zeroshard calibrate"
                                   << (nvme         ? " --nvme-path DIR"
                                       : gpu_update ? " --device cuda"
                                                    : "")
                                   << " measures it; zeroshard plan takes it typed as "
                                   << (nvme         ? "--disk-gbs"
                                       : gpu_update ? "--gpu-update-gps"
                                                    : "--memory-gbs")
                                   << ")");
  if ((gpu_state_off || (gpu && params_off)) && !(rates.h2d_gbs > 0 && rates.d2h_gbs > 0))
    ZS_THROW(invalid_argument,
             "predict_step(): a GPU engine with its optimizer or parameters off the GPU copies "
             "them over PCIe, whose rates are not measured (zeroshard calibrate --device cuda "
             "measures them; zeroshard plan takes them typed as --pcie-gbs)");
  // Muon's matrices: the parameters of its muon groups, by group id (muon_matrices()).
  std::vector<OptimizerOptions> all_groups = {cfg.optimizer};
  all_groups.insert(all_groups.end(), groups.begin(), groups.end());
  const bool muon = cfg.optimizer.kind == OptimizerKind::muon;
  if (muon) {
    if (rates.newton_schulz.empty())
      ZS_THROW(invalid_argument,
               "predict_step(): Muon's Newton-Schulz rate is not measured (zeroshard calibrate "
               "measures it; zeroshard plan takes it typed as --ns-gflops)");
    for (size_t i = 0; i < rates.newton_schulz.size(); ++i)
      if (!(rates.newton_schulz[i].first > 0 && rates.newton_schulz[i].second > 0) ||
          (i > 0 && !(rates.newton_schulz[i].first > rates.newton_schulz[i - 1].first)))
        ZS_THROW(invalid_argument,
                 "predict_step(): MachineRates::newton_schulz needs positive "
                 "points in increasing size");
  }
  const double pbytes = double(dtype_size(cfg.dtype));
  const int k = cfg.gradient_accumulation_steps;
  // Groups (Config::shard_group_size) and nodes: the rings of a collective within each group,
  // and of the all-reduce across the groups.
  const int group = cfg.shard_group_size > 0 ? cfg.shard_group_size : world;
  if (world % group != 0)
    ZS_THROW(invalid_argument,
             "predict_step(): groups of " << group << " in " << world << " ranks");
  const int per_node = rates.ranks_per_node > 0 ? rates.ranks_per_node : world;
  const int replicas = world / group;
  std::vector<std::vector<int>> within(static_cast<size_t>(replicas)),
      across(static_cast<size_t>(group));
  for (int r = 0; r < world; ++r) {
    within[size_t(r / group)].push_back(r);
    across[size_t(r % group)].push_back(r);
  }
  const int within_hops = busiest_node_hops(within, world, per_node);
  const int across_hops = busiest_node_hops(across, world, per_node);
  double crossing = 0;  // bytes the busiest node sends to other nodes per step
  // One collective of `hop` bytes per rank to the next, over rings whose busiest node sends
  // `hops` of them to other nodes: the calibrated time `local` if none, else the link's time for
  // those bytes as its kind (`link_kind`, one of rates.link's) sends them; `ring_out` is the
  // bytes one node sends per byte of the kind's measured size in the link's calibration.
  const LinkRates& link = rates.link;
  auto timed = [&](int hops, double hop, double local, double times,
                   const CollectiveRate& link_kind, double ring_out) {
    const double out = hops * hop;
    crossing += times * out;
    if (out == 0) return times * local;
    if (!(link_kind.bandwidth_gbs > 0) || link.nodes < 2)
      ZS_THROW(invalid_argument, "predict_step(): the rings cross nodes ("
                                     << per_node
                                     << " ranks per node) but the link between nodes is not "
                                        "given for every collective (MachineRates::link)");
    return times * link_kind.seconds(out / ring_out, Buffers::warm);
  };
  const double block_out = link.nodes - 1.0, buffer_out = 2.0 * (link.nodes - 1) / link.nodes;
  double updated = 0, grads = 0, gathers = 0, after = 0;  // elements; seconds of collectives
  std::vector<double> ns_load(size_t(group), 0.0);        // Muon: each rank's iteration so far
  double ns = 0;                                          // seconds of the iteration
  double param_read = 0, param_write = 0;                 // bytes of nvme parameter shards
  double down = 0, gather_up = 0;                         // bytes between the GPU and host memory
  std::vector<double> shares, update_s;  // per unit: its share of the parameters, its update
  // Per unit, in the order the update takes them: its update's seconds and its new shard's
  // upload's (a GPU with the optimizer off it and the parameters on it).
  std::vector<std::pair<double, double>> update_then_up;
  for (const PlanUnit& u : units) {
    const UnitLayout L = plan_unit(u.name, u.params, group, padding_grain(cfg));
    const double shard = double(L.shard_numel) * pbytes;
    const double ring = double(group - 1) * shard;  // a reduce-scatter or all-gather's hop
    const double mine = double(cfg.stage == 0 ? L.padded_numel : L.shard_numel);
    updated += mine;
    shares.push_back(double(L.numel));
    update_s.push_back(mine / update_rate);
    if (nvme_params) {  // a read per gather, forward and backward; one write of the new shard
      param_read += 2.0 * k * shard;
      param_write += shard;
    }
    if (gpu_state_off) {  // every micro-step's reduced shard down; the new shard up
      down += k * shard;
      if (!params_off)
        update_then_up.emplace_back(mine / update_rate, shard / (rates.h2d_gbs * 1e9));
    }
    if (gpu && params_off) gather_up += 2.0 * k * shard;  // up before each gather
    const std::vector<MuonMatrix> mats =                  // Muon: this unit's matrices
        muon ? muon_matrices(L, all_groups, ns_load) : std::vector<MuonMatrix>();
    if (!mats.empty()) {  // the unit's rounds: gather, iteration, results back (f32)
      std::vector<double> seconds;
      for (const MuonMatrix& m : mats)
        seconds.push_back(newton_schulz_seconds(rates.newton_schulz, m.cost));
      // Each round waits for its slowest iteration, and each of its two all_to_alls for the
      // rank that moves the most, timed as an all-gather moving as much per rank.
      const auto moved = [&](const std::vector<MuonTransfer>& ts) {
        std::vector<double> in(size_t(group), 0.0), out(size_t(group), 0.0);
        for (const MuonTransfer& t : ts)
          if (t.from != t.to) {
            in[size_t(t.to)] += double(t.count) * 4;
            out[size_t(t.from)] += double(t.count) * 4;
          }
        double most = 0;
        for (int r = 0; r < group; ++r) most = std::max({most, in[size_t(r)], out[size_t(r)]});
        if (most == 0) return 0.0;
        return timed(within_hops, most,
                     rates.all_gather.seconds(most / std::max(1, group - 1), Buffers::warm), 1,
                     link.all_gather, block_out);
      };
      if (group == 1) {
        for (double x : seconds) ns += x;
      } else {
        for (const MuonRound& round :
             muon_rounds(mats, group, cfg.stage == 0 ? 0 : L.shard_numel)) {
          double slowest = 0;
          for (int i : round.matrix)
            if (i >= 0) slowest = std::max(slowest, seconds[size_t(i)]);
          ns += slowest;
          after += moved(round.gather) + moved(round.scatter);
        }
      }
    }
    if (world == 1) continue;  // a one-rank engine runs no collective
    // Stages 0-1 reduce each unit's own whole gradient buffer, all units' in flight at once
    // (queued), and stage 0 gathers the reduced shards back into it, one unit at a time as each
    // reduction lands (cold); stages 2-3 reduce from reused staging slots (warm). Stages 1-2
    // gather every unit's new parameters into its whole buffer at once after the update
    // (queued). Stage 3's gathers read every unit's own shard, which no other unit reuses
    // (cold), a few units ahead.
    if (group > 1) {
      const Buffers reduced_from = cfg.stage <= 1 ? Buffers::queued : Buffers::warm;
      grads += timed(within_hops, ring, rates.reduce_scatter.seconds(shard, reduced_from), k,
                     link.reduce_scatter, block_out);
      if (cfg.stage == 0)
        grads += timed(within_hops, ring, rates.all_gather.seconds(shard, Buffers::cold), k,
                       link.all_gather, block_out);
      if (cfg.stage == 3)  // forward and backward, from each unit's own shard (cold)
        gathers += timed(within_hops, ring, rates.all_gather.seconds(shard, Buffers::cold), 2 * k,
                         link.all_gather, block_out);
      else if (cfg.stage >= 1)
        after += timed(within_hops, ring, rates.all_gather.seconds(shard, Buffers::queued), 1,
                       link.all_gather, block_out);
    }
    if (replicas > 1)  // the reduced shard, all-reduced across the groups
      grads += timed(across_hops, 2.0 * (replicas - 1) / replicas * shard,
                     across_hops > 0 ? 0 : rates.all_reduce.seconds(shard, Buffers::warm), k,
                     link.all_reduce, buffer_out);
  }
  if (!(rates.comm_overlap >= 0 && rates.comm_overlap <= 1))
    ZS_THROW(invalid_argument, "predict_step(): MachineRates::comm_overlap = "
                                   << rates.comm_overlap << ", not in [0, 1]");
  StepPrediction p;
  p.compute_s = rates.compute_s;
  // Reductions start as backward hands units over and stage-3 gathers are prefetched ahead of
  // the unit that needs them: both can hide behind the trainer's compute, once, as far as the
  // two run side by side on this machine. The all-gather of the new parameters waits for the
  // update and hides behind nothing. What runs beside them (a GPU's copies, the nvme tier's
  // reads) is charged with what it adds to the exposed time, after the collectives.
  auto exposed_of = [&](double comm) {
    return comm - rates.comm_overlap * std::min(rates.compute_s, comm);
  };
  const double exposed = exposed_of(grads + gathers);
  p.comm_s = exposed + after;
  (nvme ? p.nvme_s : p.optimizer_s) = updated / update_rate + ns;
  p.newton_schulz_s = ns;
  // The speculative step: each unit's update starts once backward (2/3 of the compute, each
  // unit's part by its parameters, the last unit's first) has handed its gradient over and the
  // unit before it is done; the trainer waits for what is left after backward. In memory the
  // update there moves more bytes than in place: the second copy of master and moments it
  // writes is read for ownership first, and the gradient's pass for the norm runs in it. On
  // nvme it moves the step's own bytes (the record read, and written to the other slot).
  // (A CPU engine's f32 parameters on the host tier at stage 3 are the master weights: no
  // second copy, no speculation.)
  const bool aliased = !gpu && cfg.stage == 3 && cfg.dtype == DType::f32 &&
                       cfg.offload_param.tier == cfg.offload_optimizer.tier;
  const bool speculating = config_detail::speculation_off(cfg, muon, gpu).empty() && !aliased;
  if (speculating) {
    double& update = nvme ? p.nvme_s : p.optimizer_s;
    p.rollback_s = update;
    const double backward = 2.0 / 3.0 * rates.compute_s;
    const double slower =
        nvme ? 1.0
             : (update_bytes_per_param(cfg) + record_bytes_per_param(cfg) + pbytes) /
                   update_bytes_per_param(cfg);
    double total = 0, landed = 0, done = 0;
    for (double s : shares) total += s;
    for (size_t i = units.size(); i-- > 0;) {
      landed += total > 0 ? backward * shares[i] / total : 0;
      done = std::max(done, landed) + update_s[i] * slower;
    }
    // On nvme a unit's update overlaps the next unit's read and the last one's write, at the
    // disk's pace; the last unit's update overlaps nothing.
    if (nvme && !units.empty() && rates.update_params_per_s > 0)
      done += update_s[0] * update_rate / rates.update_params_per_s;
    update = std::max(0.0, done - backward);
    for (auto& [unit_update, upload] : update_then_up) unit_update = 0;  // all after backward
  }
  // The GPU's copies. Downloads of the reduced shards as the reductions land, beside them (hidden
  // with them). Stage 3's shards off the GPU go up just before their gathers, on the compute
  // stream, which the trainer's kernels share (ZeroOptimizer runs the engine on torch's stream):
  // nothing hides them. The new parameters go up unit by unit as the update finishes each: a
  // two-stage pipeline whose end is max over k of (updates of units 0..k + uploads of units
  // k..last); what it adds to the update is the uploads' exposed time.
  const double copied = down > 0 ? down / (rates.d2h_gbs * 1e9) : 0;
  const double gather_up_s = gather_up > 0 ? gather_up / (rates.h2d_gbs * 1e9) : 0;
  const double with_copies = exposed_of(grads + copied + gathers);
  double pipeline = 0, updates = 0, rest = 0;  // rest: the uploads of units k..last
  for (const auto& [update, upload] : update_then_up) rest += upload;
  for (const auto& [update, upload] : update_then_up) {
    updates += update;
    pipeline = std::max(pipeline, updates + rest);
    rest -= upload;
  }
  p.pcie_s = with_copies - exposed + gather_up_s + (pipeline - updates);
  if (nvme_params) {  // reads ahead of the uploads and gathers they feed: the slower sets the pace
    const double reads = param_read / (rates.param_read_gbs * 1e9);
    p.nvme_s += exposed_of(grads + copied + std::max(gathers + gather_up_s, reads)) -
                exposed_of(grads + copied + gathers + gather_up_s) +
                param_write / (write_gbs * 1e9);
  }
  p.total_s = p.compute_s + p.comm_s + p.optimizer_s + p.pcie_s + p.nvme_s;
  p.inter_node_bytes = crossing;
  return p;
}

}  // namespace zeroshard
