// `zeroshard calibrate` (calibrate.hpp). Every figure is measured here, through the library's
// public API, on all ranks at once (the ranks share the machine's memory bandwidth and disk as
// they will when training):
// - memory: the same-bytes pass (SameBytesPass) over the streams of the mixed-precision and the
//   f32 AdamW update, in GB/s of bytes moved;
// - optimizer: an engine's update of one unit on the CPU (StepResult::optimizer_s), in
//   parameters per second, and as a fraction of the same-bytes pass of its own bytes; with the
//   moments in f32 and, under "state_formats", in bf16 and 8-bit;
// - newton_schulz: Muon's iteration as its owner rank runs it (time_newton_schulz()), on square
//   f32 matrices of 128 to 1024, as (multiply-adds, multiply-adds per second) points;
// - collectives: reduce-scatter, all-gather and all-reduce (of bf16, as hierarchical sharding's
//   across its groups) over the launched ranks at sizes from 4 KiB up, on buffers in the caches and
//   (under "cold") on buffers that are not, and the first two many at once ("queued"): every
//   measured point, the latency of the smallest and the bandwidth between the two largest; and
//   how much of the reductions the trainer's own work hides ("overlap");
// - nvme: an engine step with its optimizer state on the nvme tier (io_uring swap files in
//   --nvme-path), in parameters per second and in record bytes read and written per second;
//   the same for bf16 and 8-bit moments under "state_formats" (smaller records); and stage 3's
//   parameter shards on the nvme tier, read for gathers and written by the update ("param_tier");
// - gpu (--device cuda): pinned host memory to and from this rank's GPU (time_pcie()), and the
//   engine's fused update with its state in GPU memory (time_update()), in parameters per
//   second, per dtype and (under "state_formats") with bf16 and 8-bit moments.
// Rank 0 prints a table and writes the JSON file (schema "zeroshard-calibration/1").
#include "apps/plan/calibrate.hpp"

#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <fstream>
#include <memory>
#include <new>
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "apps/cli/subcommand.hpp"
#include "zeroshard/calibration.hpp"
#include "zeroshard/zeroshard.hpp"

namespace zsplan {

namespace {

using namespace zeroshard;
using nlohmann::json;

struct Options {
  std::string out = "zeroshard-calibration.json";
  std::string nvme_path;        // empty: no nvme measurement
  int64_t elements = 1 << 25;   // per optimizer and memory pass
  int64_t max_bytes = 1 << 26;  // largest collective
  int reps = 5;
  bool gpu = false;                // --device cuda
  int64_t pcie_bytes = 256 << 20;  // per copy
};

const char* kHelp =
    "usage: [mpirun -np N] zeroshard calibrate [--out FILE] [--nvme-path DIR] [--device cuda]\n"
    "                                          [--quick]\n\n"
    "Measures this machine for the planner, on every rank at once: memory bandwidth (the\n"
    "same-bytes pass of the optimizer's streams), the CPU optimizer's throughput (an engine's\n"
    "update, f32 and bf16), the collectives over the launched ranks (latency and bandwidth of\n"
    "reduce-scatter, all-gather and all-reduce), and with --nvme-path an engine step with its\n"
    "optimizer state on the nvme tier there. Rank 0 writes FILE (default\n"
    "zeroshard-calibration.json). --quick: smaller sizes (seconds, for tests); the figures are\n"
    "then noisier. --device cuda also measures each rank's GPU (the launcher's local rank\n"
    "modulo the GPUs): pinned host memory copied up and down (PCIe), and the engine's update\n"
    "with its state in GPU memory, for planning GPU engines (zeroshard plan --device cuda).\n";

[[noreturn]] void bad(const std::string& why) {
  throw std::invalid_argument(why);
}

Options parse(const std::vector<std::string>& args) {
  Options o;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& f = args[i];
    if (f == "--quick") {
      o.elements = 1 << 20;
      o.max_bytes = 1 << 22;
      o.pcie_bytes = 16 << 20;
      o.reps = 3;
      continue;
    }
    if (f != "--out" && f != "--nvme-path" && f != "--device")
      bad("unknown flag " + f + " (zeroshard calibrate --help)");
    if (i + 1 >= args.size()) bad(f + " needs a value (zeroshard calibrate --help)");
    const std::string& v = args[++i];
    if (f == "--device") {
      if (v != "cuda" && v != "cpu") bad("--device must be cpu or cuda, got '" + v + "'");
      o.gpu = v == "cuda";
    } else {
      (f == "--out" ? o.out : o.nvme_path) = v;
    }
  }
  return o;
}

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

std::string cpu_model() {
  std::ifstream f("/proc/cpuinfo");
  std::string line;
  while (std::getline(f, line))
    if (line.rfind("model name", 0) == 0) {
      const size_t c = line.find(':');
      return c == std::string::npos ? line : line.substr(c + 2);
    }
  return "unknown";
}

// n values of T, page-aligned and backed by transparent huge pages where the kernel allows, as
// the engine's own large buffers are (4 KiB pages cost the pass TLB misses the update does not
// have), each set to `v`.
template <class T>
struct HugeArray {
  struct Free {
    void operator()(T* p) const { std::free(p); }
  };
  std::unique_ptr<T[], Free> mem;
  HugeArray(int64_t n, T v) {
    constexpr size_t kAlign = size_t{2} << 20;
    const size_t bytes = (size_t(n) * sizeof(T) + kAlign - 1) / kAlign * kAlign;
    mem.reset(static_cast<T*>(std::aligned_alloc(kAlign, bytes)));
    if (!mem) throw std::bad_alloc();
    (void)madvise(mem.get(), bytes, MADV_HUGEPAGE);  // a hint: fine if refused
    std::fill(mem.get(), mem.get() + n, v);
  }
  T* data() const { return mem.get(); }
};

// The streams of one AdamW update per parameter: master, m, v read and written, the gradient
// read, and (low precision) the parameter copy written. f32: 4 + 4·3·2 = 28 B (the master is
// the parameter); bf16: 2 + 4·3·2 + 2 = 28 B.
struct UpdateStreams {
  explicit UpdateStreams(int64_t n)
      : master(n, 1.0f), m(n, 1.0f), v(n, 1.0f), g32(n, 1.0f), g16(n, 0x3C00), p16(n, 0) {}
  HugeArray<float> master, m, v, g32;
  HugeArray<uint16_t> g16, p16;
  double bytes_per_param(DType) const { return 28.0; }
  double pass(SameBytesPass& sb, DType d, int64_t n) {
    std::vector<MemoryStream> r = {{master.data(), 4}, {m.data(), 4}, {v.data(), 4}};
    std::vector<MemoryStream> w = r;
    if (d == DType::f32) {
      r.push_back({g32.data(), 4});
    } else {
      r.push_back({g16.data(), 2});
      w.push_back({p16.data(), 2});
    }
    return sb.run(r, w, n);
  }
};

// One engine of one unit of n parameters: the median of its update times over `reps` steps.
// `base` with each other format the rates are kept for (calibration_format()): bf16 and 8-bit
// moments, and with bf16 parameters a bf16 master under every moment format.
std::vector<Config> compact_formats(const Config& base) {
  std::vector<Config> out;
  for (bool bf16_master : {false, true}) {
    if (bf16_master && base.dtype != DType::bf16) break;
    for (StateFormat f : {StateFormat::f32, StateFormat::bf16, StateFormat::q8}) {
      if (f == StateFormat::f32 && !bf16_master) continue;  // the base itself
      Config c = base;
      c.optimizer_state = f;
      c.bf16_master = bf16_master;
      out.push_back(c);
    }
  }
  return out;
}

double optimizer_seconds(const Config& cfg, int64_t n, int reps, double* step_s = nullptr) {
  Engine e(cfg, make_self_communicator());
  e.add_unit("calibrate", {Param{"w", {n}}});
  e.finalize();
  std::vector<double> opt, step;
  std::vector<float> grad(size_t(n), 1e-3f);
  for (int s = 0; s < reps + 1; ++s) {
    for (const TensorView& g : e.grads(0))
      convert(TensorView{grad.data(), g.numel, DType::f32, Device::cpu}, g);
    const double t0 = now_s();
    e.grads_ready(0);
    const StepResult r = e.step();
    if (s == 0) continue;  // first touch of the state, first file writes
    opt.push_back(r.optimizer_s);
    step.push_back(now_s() - t0);
  }
  if (step_s) *step_s = median(step);
  return median(opt);
}

// time = latency + bytes / bandwidth: the latency is the smallest size's time, the bandwidth
// the slope between the two largest sizes (a least-squares line would be all large sizes).
// Points are (bytes per rank, seconds), in increasing size.
json fit(const std::vector<std::pair<double, double>>& pts) {
  const auto [x1, y1] = pts[pts.size() - 2];
  const auto [x2, y2] = pts.back();
  const double slope = y2 > y1 ? (y2 - y1) / (x2 - x1) : y2 / x2;
  const double latency = pts.front().second;
  json p = json::array();
  for (auto [x, y] : pts) p.push_back({x, y});
  return {{"latency_s", latency},
          {"bandwidth_gbs", slope > 0 ? 1e-9 / slope : 0.0},
          {"points_bytes_s", p}};
}

// Each collective at sizes from 4 KiB up, warm, cold and queued (time_collectives()).
json collectives(Communicator& comm, const Options& o) {
  const int world = comm.size();
  json out = {{"world", world}};
  if (world == 1) {
    out["note"] = "one rank: no collective to measure (launch under mpirun -np N)";
    return out;
  }
  std::vector<std::pair<double, double>> pts[3][3];  // [warm, cold, queued][rs, ag, ar]
  for (int64_t bytes = 4096; bytes <= o.max_bytes; bytes *= 4) {
    const CollectiveTimes t = time_collectives(comm, bytes, DType::bf16, o.reps);
    for (int c = 0; c < 3; ++c) {
      pts[0][c].push_back({double(bytes), t.warm[c]});
      pts[1][c].push_back({double(bytes), t.cold[c]});
      if (c < 2) pts[2][c].push_back({double(bytes), t.queued[c]});
    }
  }
  const char* names[3] = {"reduce_scatter", "all_gather", "all_reduce"};
  for (int c = 0; c < 3; ++c) {
    out[names[c]] = fit(pts[0][c]);
    out[names[c]]["cold"] = fit(pts[1][c]);
    if (c < 2) out[names[c]]["queued"] = fit(pts[2][c]);
  }
  return out;  // bytes: a reduce-scatter's output block per rank, an all-gather's input block
               // per rank, an all-reduce's buffer
}

// How much of the collectives the trainer's work hides ("overlap"), measured as a backward runs
// them: units of gradients written one after another (here 16 units of 4 MiB of bf16 per rank,
// filled) and each unit's reduce-scatter started on the communication thread once it is
// written. overlap = (writes alone + reductions alone - both together) / the shorter of the
// two, in [0, 1]: 1 where they run side by side unhindered, 0 where they take turns (2 ranks
// on 2 cores, each with its communication thread).
json overlap(Communicator& comm, const Options& o) {
  constexpr int kUnits = 16;
  const int64_t n = (int64_t(2) << 20) / comm.size();  // bf16 elements a rank keeps of a unit
  const int64_t per = n * comm.size();                 // a unit's gradient buffer
  std::vector<uint16_t> grads(size_t(per * kUnits)), out(size_t(n * kUnits));
  auto write = [&](int u, int r) {
    std::fill_n(grads.data() + u * per, per, uint16_t(0x3C00 + (r & 0xff)));
  };
  auto reduce = [&](int u) {
    return comm.reduce_scatter(grads.data() + u * per, out.data() + u * n, n, DType::bf16,
                               "calibrate");
  };
  std::vector<double> t[3];  // writes, reductions, both
  for (int r = 0; r < o.reps + 1; ++r) {
    double x[3];
    comm.barrier("calibrate");
    double t0 = now_s();
    for (int u = 0; u < kUnits; ++u) write(u, r);
    x[0] = now_s() - t0;
    comm.barrier("calibrate");
    t0 = now_s();
    for (int u = 0; u < kUnits; ++u) reduce(u)->wait();
    x[1] = now_s() - t0;
    comm.barrier("calibrate");
    t0 = now_s();
    std::vector<std::shared_ptr<Work>> started;
    for (int u = 0; u < kUnits; ++u) {
      write(u, r + 1);
      started.push_back(reduce(u));
    }
    for (const std::shared_ptr<Work>& w : started) w->wait();
    x[2] = now_s() - t0;
    if (r == 0) continue;  // first touch
    for (int c = 0; c < 3; ++c) t[c].push_back(x[c]);
  }
  double m[3] = {median(t[0]), median(t[1]), median(t[2])};
  comm.all_reduce(m, 3, ReduceOp::max, "calibrate")->wait();
  const double hidden = (m[0] + m[1] - m[2]) / std::min(m[0], m[1]);
  return {{"overlap", std::clamp(hidden, 0.0, 1.0)},
          {"overlap_times_s", {{"writes", m[0]}, {"reductions", m[1]}, {"both", m[2]}}}};
}

// The same value on every rank: the mean over ranks (each measured its own share at once).
double mean_over(Communicator& comm, double x) {
  comm.all_reduce(&x, 1, ReduceOp::sum, "calibrate")->wait();
  return x / comm.size();
}

// A stage-3 engine of 16 units on this rank alone, optimizer state and parameters on the tiers
// given: the medians over o.reps steps (after one that records the gather order) of its sweep
// of gathers in forward and backward order, of its update (StepResult::optimizer_s) and of its
// step().
struct Stage3Times {
  double sweep_s, update_s, step_s;
};
Stage3Times stage3_times(const Options& o, Tier optimizer, Tier params) {
  Config c;
  c.stage = 3;
  c.dtype = DType::bf16;
  c.offload_optimizer.tier = optimizer;
  c.offload_param.tier = params;
  c.offload_optimizer.nvme_paths = c.offload_param.nvme_paths = {o.nvme_path};
  Engine e(c, make_self_communicator());
  constexpr int kUnits = 16;
  for (int u = 0; u < kUnits; ++u)
    e.add_unit("p" + std::to_string(u), {Param{"w", {o.elements / kUnits}}});
  e.finalize();
  std::vector<double> sweep, update, step;
  for (int s = 0; s < o.reps + 1; ++s) {
    const double t0 = now_s();
    for (int pass = 0; pass < 2; ++pass)
      for (int i = 0; i < kUnits; ++i) {
        const int u = pass == 0 ? i : kUnits - 1 - i;
        e.gather(u);
        e.release(u);
      }
    const double t1 = now_s();
    for (int u = kUnits - 1; u >= 0; --u) {
      for (const TensorView& g : e.grads(u))
        std::fill_n(static_cast<uint16_t*>(g.data), g.numel, uint16_t(0x3a83));  // bf16 1e-3
      e.grads_ready(u);
    }
    const double t2 = now_s();
    const StepResult r = e.step();
    if (s == 0) continue;  // the first sweep records the order the reads follow
    sweep.push_back(t1 - t0);
    update.push_back(r.optimizer_s);
    step.push_back(now_s() - t2);
  }
  return {median(sweep), median(update), median(step)};
}

// Stage 3's parameters on the nvme tier (offload_param nvme), in bytes of bf16 shards per
// second, each against the same engine with its parameters in memory:
// - read_gbs: a sweep of gathers reads every shard twice (into staging, ahead in the recorded
//   order);
// - write_gbs: with the optimizer state in memory, the update first computes and writes every
//   new shard (a pass of its own, so that the state changes only once every shard is on disk):
//   the update's extra time;
// - write_with_records_gbs: with the state on the nvme tier, the new shards are written beside
//   the state's records: the step's extra time.
json param_tier(const Options& o) {
  const double bytes = double(o.elements / 16 * 16) * 2;
  const Stage3Times mem = stage3_times(o, Tier::host, Tier::nvme);
  const Stage3Times mem_ref = stage3_times(o, Tier::host, Tier::device);
  const Stage3Times rec = stage3_times(o, Tier::nvme, Tier::nvme);
  const Stage3Times rec_ref = stage3_times(o, Tier::nvme, Tier::device);
  auto rate = [&](double extra_s) { return bytes / std::max(1e-6, extra_s) / 1e9; };
  return {{"read_gbs", rate(mem.sweep_s - mem_ref.sweep_s) * 2},
          {"write_gbs", rate(mem.update_s - mem_ref.update_s)},
          {"write_with_records_gbs", rate(rec.step_s - rec_ref.step_s)}};
}

}  // namespace

int run_calibrate(const std::vector<std::string>& args) {
  Options o;
  if (const int rc = zscli::start_subcommand("calibrate", kHelp, args, parse, o); rc >= 0)
    return rc;
#ifdef ZSDEMO_HAVE_MPI
  std::shared_ptr<Communicator> comm = make_mpi_communicator();
#else
  std::shared_ptr<Communicator> comm = make_self_communicator();
#endif
  const bool talk = comm->rank() == 0;
  auto say = [&](const char* what) {
    if (talk) std::fprintf(stderr, "calibrate: %s\n", what);
  };
  try {
    if (std::string why; o.gpu && cuda_device_count(&why) == 0)  // before minutes of the rest
      throw std::runtime_error("--device cuda: no usable GPU: " + why);
    json j = {{"schema", "zeroshard-calibration/1"}};
    {
      char date[32];
      const std::time_t t = std::time(nullptr);
      std::strftime(date, sizeof date, "%FT%TZ", std::gmtime(&t));
      j["date"] = date;
    }
    SameBytesPass sb;
    j["host"] = {{"cpu", cpu_model()},
                 {"cores", int(std::thread::hardware_concurrency())},
                 {"ranks", comm->size()},
                 {"threads_per_rank", sb.threads()},
                 {"isa", sb.isa()}};

    say("memory and CPU optimizer (every rank at once)");
    UpdateStreams st(o.elements);
    json mem = json::object(), opt = json::object();
    for (DType d : {DType::f32, DType::bf16}) {
      (void)st.pass(sb, d, o.elements);  // first touch
      std::vector<double> t;
      comm->barrier("calibrate");
      for (int r = 0; r < o.reps; ++r) t.push_back(st.pass(sb, d, o.elements));
      const double gbs =
          mean_over(*comm, st.bytes_per_param(d) * double(o.elements) / median(t) / 1e9);
      mem[dtype_name(d)] = {{"same_bytes_gbs", gbs}, {"bytes_per_param", st.bytes_per_param(d)}};
      Config c;
      c.dtype = d;
      comm->barrier("calibrate");
      const double s = optimizer_seconds(c, o.elements, o.reps);
      const double pps = mean_over(*comm, double(o.elements) / s);
      opt[dtype_name(d)] = {{"params_per_s", pps},
                            {"over_same_bytes", pps * st.bytes_per_param(d) / (gbs * 1e9)}};
      for (const Config& f : compact_formats(c)) {
        comm->barrier("calibrate");
        opt[dtype_name(d)]["state_formats"][calibration_format(f)] = {
            {"params_per_s",
             mean_over(*comm, double(o.elements) / optimizer_seconds(f, o.elements, o.reps))}};
      }
    }
    j["memory"] = mem;
    j["optimizer"] = {{"adamw", opt}};

    say("Muon's Newton-Schulz iteration (every rank at once)");
    json ns = json::array();
    for (int64_t n : {128, 256, 512, 1024}) {  // square f32 matrices, 5 steps
      double madds = 0;
      comm->barrier("calibrate");
      const double s = time_newton_schulz(n, n, 5, o.reps, &madds);
      ns.push_back({madds, mean_over(*comm, madds / s)});
    }
    j["newton_schulz"] = {{"points_madds_per_s", ns},
                          {"note", "square f32 matrices of 128 to 1024, 5 steps"}};

    say("collectives");
    comm->set_timeout(300);
    j["collectives"] = collectives(*comm, o);
    if (comm->size() > 1) j["collectives"].update(overlap(*comm, o));

    if (!o.nvme_path.empty()) {
      say("nvme tier (an engine step through the swap files)");
      Config c;
      c.stage = 1;
      c.dtype = DType::bf16;
      c.offload_optimizer.tier = Tier::nvme;
      c.offload_optimizer.nvme_paths = {o.nvme_path};
      comm->barrier("calibrate");
      double step_s = 0;
      const double opt_s = optimizer_seconds(c, o.elements, o.reps, &step_s);
      // Each step reads and writes every record (f32 master and two moments: 12 B/param).
      const double pps = mean_over(*comm, double(o.elements) / step_s);
      j["nvme"] = {{"path", o.nvme_path},
                   {"params", o.elements},
                   {"step_params_per_s", pps},
                   {"record_gbs", pps * 24.0 / 1e9},
                   {"update_share", mean_over(*comm, opt_s / step_s)}};
      for (const Config& f : compact_formats(c)) {  // smaller records
        comm->barrier("calibrate");
        (void)optimizer_seconds(f, o.elements, o.reps, &step_s);
        j["nvme"]["state_formats"][calibration_format(f)] = {
            {"step_params_per_s", mean_over(*comm, double(o.elements) / step_s)}};
      }
      say("nvme parameter tier (stage 3's shards read for gathers, written by the update)");
      comm->barrier("calibrate");
      json pt = param_tier(o);
      for (const char* k : {"read_gbs", "write_gbs", "write_with_records_gbs"})
        pt[k] = mean_over(*comm, pt[k].get<double>());
      j["nvme"]["param_tier"] = pt;
    } else {
      j["nvme"] = nullptr;
    }
    if (o.gpu) {
      say("GPU (pinned copies up and down, and the update in GPU memory)");
      comm->barrier("calibrate");
      const PcieRates pcie = time_pcie(-1, o.pcie_bytes, o.reps);
      json g = {{"copy_bytes", o.pcie_bytes},
                {"h2d_gbs", mean_over(*comm, pcie.h2d_gbs)},
                {"d2h_gbs", mean_over(*comm, pcie.d2h_gbs)}};
      for (DType d : {DType::f32, DType::bf16}) {
        Config c;
        c.dtype = d;
        c.device = Device::cuda;  // the local rank's GPU
        auto rate = [&](const Config& f) {
          comm->barrier("calibrate");
          return mean_over(*comm, double(o.elements) / time_update(f, o.elements, o.reps));
        };
        g["adamw"][dtype_name(d)] = {{"params_per_s", rate(c)}};
        for (StateFormat f : {StateFormat::bf16, StateFormat::q8}) {  // a GPU keeps an f32 master
          c.optimizer_state = f;
          g["adamw"][dtype_name(d)]["state_formats"][state_format_name(f)] = {
              {"params_per_s", rate(c)}};
        }
      }
      j["gpu"] = g;
    } else {
      j["gpu"] = nullptr;
    }

    if (talk) {
      std::ofstream f(o.out);
      f << j.dump(2) << "\n";
      if (!f) throw std::runtime_error("cannot write " + o.out);
      std::printf("calibration of %s (%d rank(s), %d threads each, %s) -> %s\n",
                  j["host"]["cpu"].get<std::string>().c_str(), comm->size(), sb.threads(), sb.isa(),
                  o.out.c_str());
      for (const char* d : {"f32", "bf16"}) {
        const json& a = j["optimizer"]["adamw"][d];
        std::printf(
            "  %-4s same-bytes %7.2f GB/s per rank; AdamW %7.3f Gparam/s per rank (%.2f of "
            "its same-bytes pass); bf16 moments %.3f, 8-bit %.3f Gparam/s\n",
            d, j["memory"][d]["same_bytes_gbs"].get<double>(),
            a["params_per_s"].get<double>() / 1e9, a["over_same_bytes"].get<double>(),
            a["state_formats"]["bf16"]["params_per_s"].get<double>() / 1e9,
            a["state_formats"]["8bit"]["params_per_s"].get<double>() / 1e9);
      }
      std::printf("  Newton-Schulz");
      for (const json& p : j["newton_schulz"]["points_madds_per_s"])
        std::printf(" %.3g madds at %.2f GFLOP/s;", p[0].get<double>(),
                    2 * p[1].get<double>() / 1e9);
      std::printf(" per rank\n");
      const json& cl = j["collectives"];
      for (const char* k : {"reduce_scatter", "all_gather", "all_reduce"})
        if (cl.contains(k))
          std::printf("  %-14s latency %8.1f us, bandwidth %7.2f GB/s\n", k,
                      cl[k]["latency_s"].get<double>() * 1e6, cl[k]["bandwidth_gbs"].get<double>());
      if (cl.contains("overlap"))
        std::printf("  overlap        %.2f of the reductions hidden behind the gradients' writes\n",
                    cl["overlap"].get<double>());
      if (!j["nvme"].is_null())
        std::printf(
            "  nvme step     %7.3f Gparam/s per rank, records %.2f GB/s read+write; bf16 "
            "moments %.3f, 8-bit %.3f Gparam/s\n",
            j["nvme"]["step_params_per_s"].get<double>() / 1e9,
            j["nvme"]["record_gbs"].get<double>(),
            j["nvme"]["state_formats"]["bf16"]["step_params_per_s"].get<double>() / 1e9,
            j["nvme"]["state_formats"]["8bit"]["step_params_per_s"].get<double>() / 1e9);
      if (!j["nvme"].is_null())
        std::printf(
            "  nvme params   shards read %.2f GB/s for gathers, written %.2f GB/s by the "
            "update (%.2f GB/s beside nvme state)\n",
            j["nvme"]["param_tier"]["read_gbs"].get<double>(),
            j["nvme"]["param_tier"]["write_gbs"].get<double>(),
            j["nvme"]["param_tier"]["write_with_records_gbs"].get<double>());
      if (!j["gpu"].is_null())
        std::printf(
            "  gpu           pinned copies up %.2f GB/s, down %.2f GB/s; AdamW in GPU memory "
            "f32 %.2f, bf16 %.2f Gparam/s per rank\n",
            j["gpu"]["h2d_gbs"].get<double>(), j["gpu"]["d2h_gbs"].get<double>(),
            j["gpu"]["adamw"]["f32"]["params_per_s"].get<double>() / 1e9,
            j["gpu"]["adamw"]["bf16"]["params_per_s"].get<double>() / 1e9);
    }
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "zeroshard calibrate: rank %d: %s\n", comm->rank(), e.what());
    return 1;
  }
}

}  // namespace zsplan
