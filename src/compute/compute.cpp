// The CPU backend of Compute, the CPU backends' element-wise work (cpu_work.hpp), and the
// choice of backend.
#include "src/compute/compute.hpp"

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "base/check.hpp"
#include "kernels/cpu/grad_passes.hpp"
#include "src/compute/cpu_work.hpp"
#include "zeroshard/config.hpp"
#include "zeroshard/error.hpp"
#include "zeroshard/launch.hpp"

namespace zeroshard {

namespace cpu_work {

void convert(cpu::Arena& arena, const void* src, DType sd, void* dst, DType dd, int64_t n) {
  if (src == dst && sd == dd) return;  // f32 master weights that are the parameters
  const size_t ss = dtype_size(sd), ds = dtype_size(dd);
  arena.parallel_chunks(n, [&](int64_t b, int64_t e) {
    cpu::convert(arena.isa(), static_cast<const char*>(src) + size_t(b) * ss, sd,
                 static_cast<char*>(dst) + size_t(b) * ds, dd, e - b);
  });
}

void accumulate(cpu::Arena& arena, float* acc, const void* g, DType gd, int64_t n) {
  const size_t gs = dtype_size(gd);
  arena.parallel_chunks(n, [&](int64_t b, int64_t e) {
    cpu::accumulate(arena.isa(), acc + b, static_cast<const char*>(g) + size_t(b) * gs, gd, e - b);
  });
}

void update(cpu::Arena& arena, const std::vector<cpu::UpdateHyper>& hyper,
            const std::vector<cpu::UnitUpdate>& units) {
  std::vector<cpu::UpdateTask> tasks;
  for (const cpu::UnitUpdate& u : units) cpu::append_update_tasks(hyper, u, tasks);
  cpu::run_update_tasks(arena, tasks);
}

void muon_average(cpu::Arena& arena, const cpu::UpdateArgs& a, const cpu::UpdateHyper& h,
                  int64_t lo, int64_t hi, float* d, std::vector<float>& wide) {
  cpu::muon_average(arena.isa(), a, h, lo, hi, d, wide);
}

void newton_schulz(float* x, int64_t rows, int64_t cols, const cpu::NsOptions& o, float* scratch) {
  cpu::newton_schulz(x, rows, cols, o.steps, o.eps, o.bf16, scratch);
  for (int64_t i = 0; i < rows * cols; ++i) x[i] *= o.scale;
}

double sum_squares(cpu::Arena& arena, const GradSpan& x) {
  return cpu::parallel_sum_squares(arena, x.data, x.dtype, x.n);
}

}  // namespace cpu_work

namespace {

class CpuCompute final : public Compute {
 public:
  explicit CpuCompute(cpu::Arena& arena) : arena_(arena) {}

  Device device() const override { return Device::cpu; }
  int device_index() const override { return 0; }
  bool streams() const override { return false; }
  Allocator* device_memory() override { return nullptr; }
  Allocator* pinned_memory() override { return nullptr; }

  void fill(void* p, unsigned char value, size_t bytes) override {
    if (bytes) std::memset(p, value, bytes);
  }
  void convert(const void* src, DType sd, void* dst, DType dd, int64_t n) override {
    cpu_work::convert(arena_, src, sd, dst, dd, n);
  }
  void accumulate(float* acc, const void* g, DType gd, int64_t n) override {
    cpu_work::accumulate(arena_, acc, g, gd, n);
  }
  void update(const std::vector<cpu::UpdateHyper>& hyper,
              const std::vector<UnitUpdate>& units) override {
    cpu_work::update(arena_, hyper, units);
  }
  void muon_average(const cpu::UpdateArgs& a, const cpu::UpdateHyper& h, int64_t lo, int64_t hi,
                    float* d) override {
    cpu_work::muon_average(arena_, a, h, lo, hi, d, wide_);
  }
  void newton_schulz(float* x, int64_t rows, int64_t cols, const cpu::NsOptions& o,
                     float* scratch) override {
    cpu_work::newton_schulz(x, rows, cols, o, scratch);
  }
  std::pair<double, bool> sum_squares(const std::vector<GradSpan>& spans) override {
    double s = 0.0;
    for (const GradSpan& g : spans) s += cpu_work::sum_squares(arena_, g);
    // A square of an inf or NaN makes the sum inf or NaN: no separate flag pass on the CPU.
    return {s, !std::isfinite(s)};
  }
  void copy(void* dst, const void* src, size_t bytes) override {
    if (bytes) std::memcpy(dst, src, bytes);
  }
  void download(void* host, const void* dev, size_t bytes) override { copy(host, dev, bytes); }
  void synchronize() override {}
  void hand_to_trainer() override {}
  std::shared_ptr<void> register_host(void*, size_t) override { return nullptr; }
  std::shared_ptr<Communicator> adapt(std::shared_ptr<Communicator> comm) override { return comm; }
  void before_collective() override {}
  void* stream() const override { return nullptr; }
  void set_stream(void* stream) override {
    if (stream)
      ZS_THROW(invalid_argument,
               "set_stream(): the engine runs on the CPU (Config::device = "
               "cpu); streams belong to the cuda device");
  }

 private:
  cpu::Arena& arena_;
  std::vector<float> wide_;  // muon_average()'s widened 8-bit momentum
};

}  // namespace

std::unique_ptr<Compute> make_cpu_compute(cpu::Arena& arena) {
  return std::make_unique<CpuCompute>(arena);
}

namespace {

// ZEROSHARD_<name> as an integer in [0, most], or `fallback` when unset; a malformed value is an
// error naming the variable (a test suite that asked for a seed must get that seed).
int64_t env_int(const char* name, int64_t fallback, int64_t most) {
  const char* v = std::getenv(name);
  if (!v || !*v) return fallback;
  char* end = nullptr;
  errno = 0;
  const long long x = std::strtoll(v, &end, 10);
  if (*end != '\0' || errno != 0 || x < 0 || x > most)
    ZS_THROW(invalid_config, name << "=" << v << ": expected an integer from 0 to " << most);
  return x;
}

}  // namespace

bool async_device_selected(const Config& cfg) {
  if (cfg.device != Device::cpu) return false;
  const char* v = std::getenv("ZEROSHARD_ASYNC_DEVICE");
  if (!v || !*v) return cfg.async_device;
  const std::string s(v);
  if (s == "0") return false;
  if (s != "1") ZS_THROW(invalid_config, "ZEROSHARD_ASYNC_DEVICE=" << s << ": expected 0 or 1");
  // The test suite's switch runs every engine a GPU would take as on a GPU; the others (stage 0
  // with the optimizer on the host, say) stay on the synchronous CPU device, which takes them.
  Config as_gpu = cfg;
  as_gpu.async_device = true;
  try {
    as_gpu.validate();
  } catch (const Error&) {
    return false;
  }
  return true;
}

std::unique_ptr<Compute> make_compute(const Config& cfg, cpu::Arena& arena) {
  if (async_device_selected(cfg)) {
    // Each rank draws its own delays, reproducibly for a given seed.
    const uint64_t seed = uint64_t(env_int("ZEROSHARD_ASYNC_SEED", 1, INT64_MAX)) * 1000003u +
                          uint64_t(launch_info().rank);
    const char* comm = std::getenv("ZEROSHARD_ASYNC_COMM");
    const std::string c = comm ? comm : "";
    if (!c.empty() && c != "nccl" && c != "staged")
      ZS_THROW(invalid_config, "ZEROSHARD_ASYNC_COMM=" << c << ": expected nccl or staged");
    // At most 10 s before each piece of work: longer would only make a test time out.
    return make_async_cpu_compute(arena, seed,
                                  int(env_int("ZEROSHARD_ASYNC_JITTER_US", 50, 10'000'000)),
                                  c == "staged" ? AsyncComm::staged : AsyncComm::nccl);
  }
  if (cfg.device == Device::cpu) return make_cpu_compute(arena);
#ifdef ZEROSHARD_HAVE_CUDA
  if (cfg.device_index >= 0) return make_cuda_compute(cfg.device_index, -1);
  return make_cuda_compute(-1, launch_info().local_rank);
#else
  ZS_THROW(invalid_config,
           "zeroshard.device = cuda, but this zeroshard was built without CUDA "
           "(ZEROSHARD_WITH_CUDA=OFF); use device cpu or rebuild with CUDA");
#endif
}

}  // namespace zeroshard
