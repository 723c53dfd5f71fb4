// GPU benchmark: a host-offloaded optimizer step of a 1B-parameter model against its floors,
// measured in one run (docs/DESIGN.md rule 9).
//
// The engine: stage 2, bf16 parameters and gradients on GPU 0, AdamW with its f32 master weights
// and moments on the host tier (pinned memory; the CPU runs the update), one rank over NCCL.
// One step, as a trainer drives it: for every unit, grads() (the engine's zeroed gradient
// buffer), a cudaMemsetAsync on the engine's stream standing in for backward's gradient kernel,
// grads_ready(); then step(), and a wait on the engine's stream so the step's parameter uploads
// are counted. The step moves each gradient shard down (2 B/parameter) and each updated bf16
// parameter up (2 B/parameter), and the CPU runs AdamW over 16 B/parameter of f32 state plus the
// gradient and the copy-out.
//
// Floors, measured in the same process:
//   PCIe floor  = 2 B/param at the pinned D2H bandwidth + 2 B/param at the pinned H2D bandwidth
//                 (serial; a full-duplex link could overlap the two, which the max also shown
//                 bounds), with the bandwidths of 256 MiB cudaMemcpyAsync copies from/to
//                 cudaHostAlloc memory, re-measured before every step.
//   CPU floor   = the step's own StepResult::optimizer_s: the CPU update (the uploads are issued
//                 unit by unit inside it, overlapping the next unit's update).
// Reported: the median step, the floors, and step / PCIe floor and step / max(floors) as
// medians of per-step ratios (each step against the floors measured just before it).
//
// Usage: offload_step_bench [--params N] [--unit-params N] [--steps N] [--out FILE]
// Sizes take a plain number (1e9, 1000000000) or a Ki/Mi/Gi suffix (64Mi).
// The probe's buffers (256 MiB pinned, 256 MiB on the GPU) live beside the engine, outside its
// ledger.
// Exit codes: 0 ok, 1 a failure during the run, 2 bad arguments or no usable GPU, 3 host memory
// too short (also when the engine's allocation fails with a zeroshard::Error saying so).

#include <cuda_runtime_api.h>
#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iostream>
#include <memory>
#include <new>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "benchmarks/io/parse_size.hpp"
#include "zeroshard/calibration.hpp"
#include "zeroshard/zeroshard.hpp"

namespace zs = zeroshard;

namespace {

constexpr const char* kName = "offload_step_bench";

// A failed CUDA call: the expression and CUDA's explanation.
#define BENCH_CUDA(expr)                                                                       \
  do {                                                                                         \
    const cudaError_t bench_e_ = (expr);                                                       \
    if (bench_e_ != cudaSuccess)                                                               \
      throw std::runtime_error(std::string(#expr) + " failed: " + cudaGetErrorName(bench_e_) + \
                               ": " + cudaGetErrorString(bench_e_));                           \
  } while (0)

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t m = v.size() / 2;
  return v.size() % 2 ? v[m] : 0.5 * (v[m - 1] + v[m]);
}

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

[[noreturn]] void usage(const std::string& why) {
  std::cerr << kName << ": " << why << "\n"
            << "usage: " << kName
            << " [--params N (default 1e9)] [--unit-params N (default 64Mi)] [--steps N "
               "(default 5)] [--out FILE]\n";
  std::exit(2);
}

// "1e9", "1000000000", "64Mi", "2Gi", "512Ki": a positive element count.
int64_t parse_count(const std::string& flag, const std::string& s) {
  const int64_t n = zeroshard::bench::parse_size(s);
  if (n <= 0) usage(flag + " takes a positive count such as 1e9 or 64Mi, not '" + s + "'");
  return n;
}

struct Options {
  int64_t params = 1000000000;
  int64_t unit_params = int64_t{64} << 20;
  int steps = 5;
  std::string out;
};

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) usage("missing value after " + a);
      return argv[++i];
    };
    if (a == "--params") {
      o.params = parse_count(a, next());
    } else if (a == "--unit-params") {
      o.unit_params = parse_count(a, next());
    } else if (a == "--steps") {
      o.steps = int(parse_count(a, next()));
    } else if (a == "--out") {
      o.out = next();
    } else {
      usage("unknown argument '" + a + "'");
    }
  }
  return o;
}

// MemAvailable from /proc/meminfo in bytes, or -1 if it cannot be read.
int64_t host_available_bytes() {
  std::ifstream f("/proc/meminfo");
  std::string key;
  int64_t kib = 0;
  std::string unit;
  while (f >> key >> kib) {
    std::getline(f, unit);
    if (key == "MemAvailable:") return kib * 1024;
  }
  return -1;
}

// Pinned host ↔ device bandwidth: cudaMemcpyAsync of one buffer on one stream, timed with
// events. Owns its buffers (freed by the destructor, which never throws).
class PcieProbe {
 public:
  explicit PcieProbe(size_t bytes) : bytes_(bytes) {
    BENCH_CUDA(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    BENCH_CUDA(cudaEventCreate(&start_));
    BENCH_CUDA(cudaEventCreate(&stop_));
    BENCH_CUDA(cudaHostAlloc(&host_, bytes, cudaHostAllocDefault));
    BENCH_CUDA(cudaMalloc(&dev_, bytes));
    std::memset(host_, 1, bytes);
    BENCH_CUDA(cudaMemset(dev_, 1, bytes));
  }
  ~PcieProbe() {
    if (dev_) (void)cudaFree(dev_);
    if (host_) (void)cudaFreeHost(host_);
    if (stop_) (void)cudaEventDestroy(stop_);
    if (start_) (void)cudaEventDestroy(start_);
    if (stream_) (void)cudaStreamDestroy(stream_);
  }
  PcieProbe(const PcieProbe&) = delete;
  PcieProbe& operator=(const PcieProbe&) = delete;

  // GB/s (1e9 bytes per second) of one copy.
  double once(bool h2d) {
    BENCH_CUDA(cudaEventRecord(start_, stream_));
    if (h2d)
      BENCH_CUDA(cudaMemcpyAsync(dev_, host_, bytes_, cudaMemcpyHostToDevice, stream_));
    else
      BENCH_CUDA(cudaMemcpyAsync(host_, dev_, bytes_, cudaMemcpyDeviceToHost, stream_));
    BENCH_CUDA(cudaEventRecord(stop_, stream_));
    BENCH_CUDA(cudaEventSynchronize(stop_));
    float ms = 0;
    BENCH_CUDA(cudaEventElapsedTime(&ms, start_, stop_));
    return double(bytes_) / (double(ms) * 1e6);
  }
  // Median GB/s of `rounds` copies each way, the directions alternating: {h2d, d2h}.
  std::pair<double, double> measure(int rounds) {
    std::vector<double> h2d, d2h;
    for (int r = 0; r < rounds; ++r) {
      if (r % 2 == 0) {
        h2d.push_back(once(true));
        d2h.push_back(once(false));
      } else {
        d2h.push_back(once(false));
        h2d.push_back(once(true));
      }
    }
    return {median(h2d), median(d2h)};
  }

 private:
  size_t bytes_;
  cudaStream_t stream_ = nullptr;
  cudaEvent_t start_ = nullptr, stop_ = nullptr;
  void* host_ = nullptr;
  void* dev_ = nullptr;
};

// One bf16 value as float (the upper half of binary32).
float bf16_to_float(uint16_t b) {
  const uint32_t u = uint32_t(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

struct StepSample {
  double step_s, optimizer_s, same_bytes_s, pcie_floor_s, h2d_gbs, d2h_gbs;
};

// The memory ceiling of the CPU update: the streams AdamW moves per parameter (f32 master, m, v
// read and written in place, the bf16 gradient read, the bf16 parameter written: 28 B), over
// one unit's worth of elements, passed once per unit, on the engine's threads and ISA.
class UpdateCeiling {
 public:
  explicit UpdateCeiling(int64_t n)
      : n_(n),
        master_(huge<float>(n, 1.0f)),
        m_(huge<float>(n, 1.0f)),
        v_(huge<float>(n, 1.0f)),
        g_(huge<uint16_t>(n, 0x3C3C)),
        p_(huge<uint16_t>(n, 0)) {}
  double run(int64_t passes) {
    const std::vector<zs::MemoryStream> reads = {
        {master_.get(), 4}, {m_.get(), 4}, {v_.get(), 4}, {g_.get(), 2}};
    const std::vector<zs::MemoryStream> writes = {
        {master_.get(), 4}, {m_.get(), 4}, {v_.get(), 4}, {p_.get(), 2}};
    double t = 0;
    for (int64_t i = 0; i < passes; ++i) t += pass_.run(reads, writes, n_);
    return t;
  }
  const zs::SameBytesPass& pass() const { return pass_; }

 private:
  struct Free {
    void operator()(void* p) const { std::free(p); }
  };
  template <class T>
  using Array = std::unique_ptr<T[], Free>;
  // On transparent huge pages, as the engine's own large buffers are: 4 KiB pages cost the pass
  // TLB misses the update does not have.
  template <class T>
  static Array<T> huge(int64_t n, T v) {
    constexpr size_t kAlign = size_t{2} << 20;
    const size_t bytes = (size_t(n) * sizeof(T) + kAlign - 1) / kAlign * kAlign;
    Array<T> a(static_cast<T*>(std::aligned_alloc(kAlign, bytes)));
    if (!a) throw std::bad_alloc();
    (void)madvise(a.get(), bytes, MADV_HUGEPAGE);
    std::fill(a.get(), a.get() + n, v);
    return a;
  }

  int64_t n_;
  Array<float> master_, m_, v_;
  Array<uint16_t> g_, p_;
  zs::SameBytesPass pass_;
};

int run(const Options& o) {
  std::ostringstream report;
  auto say = [&](const std::string& s) {
    std::cout << s << std::flush;
    report << s;
  };
  char line[2048];

  // ---- the GPU --------------------------------------------------------------------------------
  int ndev = 0;
  const cudaError_t ce = cudaGetDeviceCount(&ndev);
  if (ce != cudaSuccess || ndev == 0) {
    std::cerr << kName << ": no CUDA GPU on this machine: "
              << (ce != cudaSuccess
                      ? std::string(cudaGetErrorName(ce)) + ": " + cudaGetErrorString(ce)
                      : std::string("cudaGetDeviceCount found 0 devices"))
              << "\n";
    return 2;
  }
  BENCH_CUDA(cudaSetDevice(0));
  cudaDeviceProp prop{};
  BENCH_CUDA(cudaGetDeviceProperties(&prop, 0));

  const int64_t units =
      std::max<int64_t>(1, std::llround(double(o.params) / double(o.unit_params)));
  const int64_t n = units * o.unit_params;
  // Host tier, per parameter: f32 master, m, v (12 B), the bf16 gradient shard and the bf16
  // upload buffer (2 + 2 B): a lower bound; the engine's ledger below gives the real figure.
  const int64_t host_need = n * 16;
  const int64_t host_avail = host_available_bytes();

  std::snprintf(line, sizeof line,
                "# %s\ndevice: %s (sm_%d%d, %d SMs, %zu MiB)\n"
                "model: %lld parameters = %lld units of %lld (stage 2, bf16 params and grads on "
                "GPU 0, AdamW state f32 on the host tier, pinned; one rank over NCCL)\n"
                "host memory: at least %.1f GiB needed (16 B/param), %.1f GiB available\n"
                "steps: 2 warm-up, %d measured\n\n",
                kName, prop.name, prop.major, prop.minor, prop.multiProcessorCount,
                size_t(prop.totalGlobalMem >> 20), static_cast<long long>(n),
                static_cast<long long>(units), static_cast<long long>(o.unit_params),
                double(host_need) / (1 << 30),
                host_avail >= 0 ? double(host_avail) / (1 << 30) : -1.0, o.steps);
  say(line);
  if (host_avail >= 0 && host_avail < host_need) {
    std::cerr << kName << ": host memory too short: the host tier needs at least "
              << host_need / (1 << 20) << " MiB for " << n << " parameters, "
              << host_avail / (1 << 20)
              << " MiB available (MemAvailable); try a smaller --params\n";
    return 3;
  }

  // ---- PCIe bandwidth, before the engine exists -----------------------------------------------
  const size_t probe_bytes = size_t(256) << 20;
  PcieProbe probe(probe_bytes);
  (void)probe.measure(2);  // warm-up
  const auto [h2d0, d2h0] = probe.measure(9);
  std::snprintf(line, sizeof line,
                "pinned PCIe, 256 MiB cudaMemcpyAsync, median of 9 (before the engine): H2D %.2f "
                "GB/s, D2H %.2f GB/s\n",
                h2d0, d2h0);
  say(line);

  // ---- the engine -----------------------------------------------------------------------------
  zs::Config c;
  c.stage = 2;
  c.dtype = zs::DType::bf16;
  c.optimizer.kind = zs::OptimizerKind::adamw;
  c.device = zs::Device::cuda;
  c.device_index = 0;
  c.offload_optimizer.tier = zs::Tier::host;
  c.offload_optimizer.pin_memory = true;
  c.grad_buffers = 2;
  const double t_build = now_s();
  zs::Engine e(c, zs::make_nccl_communicator(0, zs::make_self_communicator()));
  for (int64_t u = 0; u < units; ++u) {
    zs::Param p;
    p.name = "w";
    p.shape = {o.unit_params};
    e.add_unit("unit" + std::to_string(u), {p});
  }
  e.finalize();
  std::snprintf(line, sizeof line, "engine built and finalized in %.1f s\n\n", now_s() - t_build);
  say(line);
  const auto stream = static_cast<cudaStream_t>(e.stream());
  UpdateCeiling ceiling(o.unit_params);
  (void)ceiling.run(1);  // warm-up

  // ---- steps ----------------------------------------------------------------------------------
  // 0x3C in every byte: bf16 0x3C3C ≈ 0.0115, a finite non-zero gradient, so the step really
  // updates (zeros would cost the same; a non-zero norm shows the gradients arrived).
  const double bytes_pcie = double(n) * 2;  // each way: bf16 gradients down, bf16 params up
  std::vector<StepSample> samples;
  zs::StepResult last;
  for (int s = 0; s < 2 + o.steps; ++s) {
    const bool measured = s >= 2;
    StepSample smp{};
    if (measured) {
      // The floors of this step, measured just before it.
      const auto [h2d, d2h] = probe.measure(3);
      smp.h2d_gbs = h2d;
      smp.d2h_gbs = d2h;
      smp.pcie_floor_s = bytes_pcie / (d2h * 1e9) + bytes_pcie / (h2d * 1e9);
      smp.same_bytes_s = ceiling.run(units);
    }
    const double t0 = now_s();
    for (int64_t u = 0; u < units; ++u) {
      const std::vector<zs::TensorView> g = e.grads(zs::UnitId(u));
      for (const zs::TensorView& v : g)
        BENCH_CUDA(cudaMemsetAsync(v.data, 0x3C, v.bytes(), stream));
      e.grads_ready(zs::UnitId(u));
    }
    last = e.step();
    BENCH_CUDA(cudaStreamSynchronize(stream));
    smp.step_s = now_s() - t0;
    smp.optimizer_s = last.optimizer_s;
    if (last.skipped || !(last.grad_norm > 0) || !std::isfinite(last.grad_norm))
      throw std::runtime_error("step " + std::to_string(s + 1) +
                               " was skipped or saw no gradient: grad norm " +
                               std::to_string(last.grad_norm));
    std::snprintf(line, sizeof line, "%s step %d: %.3f s, optimizer_s %.3f s%s\n",
                  measured ? "measured" : "warm-up", s + 1, smp.step_s, smp.optimizer_s,
                  measured ? "" : " (not counted)");
    if (measured)
      std::snprintf(line + std::strlen(line) - 1, sizeof line - std::strlen(line) + 1,
                    ", same-bytes pass %.3f s\n", smp.same_bytes_s);
    say(line);
    if (measured) samples.push_back(smp);
  }

  // The update must have moved the parameters: with a constant gradient AdamW moves each one
  // by about lr per step (all start at zero).
  uint16_t p0 = 0;
  const std::vector<zs::TensorView> pv = e.params(0);
  BENCH_CUDA(cudaMemcpy(&p0, pv.at(0).data, 2, cudaMemcpyDeviceToHost));
  const float first = bf16_to_float(p0);

  std::vector<double> step_s, opt_s, same_s, pcie_s, h2d, d2h, r_pcie, r_max, r_same, r_floor;
  for (const StepSample& x : samples) {
    step_s.push_back(x.step_s);
    opt_s.push_back(x.optimizer_s);
    pcie_s.push_back(x.pcie_floor_s);
    h2d.push_back(x.h2d_gbs);
    d2h.push_back(x.d2h_gbs);
    r_pcie.push_back(x.step_s / x.pcie_floor_s);
    r_max.push_back(x.step_s / std::max(x.pcie_floor_s, x.optimizer_s));
    same_s.push_back(x.same_bytes_s);
    r_same.push_back(x.optimizer_s / x.same_bytes_s);
    r_floor.push_back(x.step_s / std::max(x.pcie_floor_s, x.same_bytes_s));
  }
  const double pcie_duplex =
      std::max(bytes_pcie / (median(d2h) * 1e9), bytes_pcie / (median(h2d) * 1e9));
  std::snprintf(
      line, sizeof line,
      "\nstep (grads + grads_ready of every unit, step(), stream sync): median %.3f s (min %.3f, "
      "max %.3f), %.2f Gparam/s\n"
      "PCIe floor: %.3f s (%.2f GB down at D2H %.2f GB/s + %.2f GB up at H2D %.2f GB/s, "
      "medians of the per-step probes; full-duplex bound, max of the two: %.3f s)\n"
      "CPU-update floor (StepResult::optimizer_s): median %.3f s, %.2f Gparam/s\n"
      "step / PCIe floor: %.2f (median of per-step ratios)\n"
      "step / max(PCIe floor, CPU-update floor): %.2f (median of per-step ratios)\n"
      "CPU memory floor (same-bytes pass of the update's 28 B/param, %d threads, %s): median "
      "%.3f s; CPU update / same-bytes pass: %.2f; step / max(PCIe floor, same-bytes pass): "
      "%.2f (medians of per-step ratios)\n"
      "check: grad norm %.4g (expected ~%.4g), first parameter after %d steps %.5g (starts at 0, "
      "expected about %.3g: AdamW moves it by lr against a constant gradient)\n",
      median(step_s), *std::min_element(step_s.begin(), step_s.end()),
      *std::max_element(step_s.begin(), step_s.end()), double(n) / median(step_s) / 1e9,
      median(pcie_s), bytes_pcie / 1e9, median(d2h), bytes_pcie / 1e9, median(h2d), pcie_duplex,
      median(opt_s), double(n) / median(opt_s) / 1e9, median(r_pcie), median(r_max),
      ceiling.pass().threads(), ceiling.pass().isa(), median(same_s), median(r_same),
      median(r_floor), last.grad_norm, double(bf16_to_float(0x3C3C)) * std::sqrt(double(n)),
      2 + o.steps, double(first), -double(c.optimizer.lr) * (2 + o.steps));
  say(line);
  if (first == 0.0f || !std::isfinite(first))
    throw std::runtime_error("the parameters did not change: the step did not update");
  say("\nledger (e.memory()):\n" + e.memory().to_string() + "\n");

  if (!o.out.empty()) {
    std::ofstream f(o.out);
    f << report.str();
    if (!f) {
      std::cerr << kName << ": cannot write " << o.out << "\n";
      return 1;
    }
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const Options o = parse(argc, argv);
  if (o.steps < 1) usage("--steps must be at least 1");
  if (o.unit_params > o.params) usage("--unit-params is larger than --params");
  try {
    return run(o);
  } catch (const zs::Error& e) {
    // The engine's allocations (pinned host tier, device buffers) fail with a code saying which.
    std::cerr << kName << ": zeroshard::Error (" << zs::error_code_name(e.code())
              << "): " << e.what() << "\n";
    return e.code() == zs::ErrorCode::no_space ? 3 : 1;
  } catch (const std::exception& e) {
    std::cerr << kName << ": " << e.what() << "\n";
    return 1;
  }
}
