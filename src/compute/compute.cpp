// The CPU backend of Compute, and the choice of backend.
#include "src/compute/compute.hpp"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>

#include "kernels/cpu/grad_passes.hpp"
#include "base/check.hpp"
#include "zeroshard/config.hpp"
#include "zeroshard/error.hpp"
#include "zeroshard/launch.hpp"

namespace zeroshard {

namespace {

class CpuCompute final : public Compute {
 public:
  explicit CpuCompute(cpu::Arena& arena) : arena_(arena) {}

  Device device() const override { return Device::cpu; }
  int device_index() const override { return 0; }
  Allocator* device_memory() override { return nullptr; }
  Allocator* pinned_memory() override { return nullptr; }

  void fill(void* p, unsigned char value, size_t bytes) override {
    if (bytes) std::memset(p, value, bytes);
  }
  void convert(const void* src, DType sd, void* dst, DType dd, int64_t n) override {
    if (src == dst && sd == dd) return;  // f32 master weights that are the parameters
    const size_t ss = dtype_size(sd), ds = dtype_size(dd);
    arena_.parallel_chunks(n, [&](int64_t b, int64_t e) {
      cpu::convert(arena_.isa(), static_cast<const char*>(src) + size_t(b) * ss, sd,
                   static_cast<char*>(dst) + size_t(b) * ds, dd, e - b);
    });
  }
  void accumulate(float* acc, const void* g, DType gd, int64_t n) override {
    const size_t gs = dtype_size(gd);
    arena_.parallel_chunks(n, [&](int64_t b, int64_t e) {
      cpu::accumulate(arena_.isa(), acc + b, static_cast<const char*>(g) + size_t(b) * gs, gd,
                      e - b);
    });
  }
  void update(const std::vector<cpu::UpdateHyper>& hyper,
              const std::vector<UnitUpdate>& units) override {
    std::vector<cpu::UpdateTask> tasks;
    for (const UnitUpdate& u : units) cpu::append_update_tasks(hyper, u, tasks);
    cpu::run_update_tasks(arena_, tasks);
  }
  std::pair<double, bool> sum_squares(const std::vector<GradSpan>& spans) override {
    double s = 0.0;
    for (const GradSpan& g : spans) s += cpu::parallel_sum_squares(arena_, g.data, g.dtype, g.n);
    // A square of an inf or NaN makes the sum inf or NaN: no separate flag pass on the CPU.
    return {s, !std::isfinite(s)};
  }
  void copy(void* dst, const void* src, size_t bytes) override {
    if (bytes) std::memcpy(dst, src, bytes);
  }
  void download(void* host, const void* dev, size_t bytes) override { copy(host, dev, bytes); }
  void synchronize() override {}
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
};

}  // namespace

std::unique_ptr<Compute> make_cpu_compute(cpu::Arena& arena) {
  return std::make_unique<CpuCompute>(arena);
}

std::unique_ptr<Compute> make_compute(const Config& cfg, cpu::Arena& arena) {
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
