// The CUDA backend of Compute: device memory for Tier::device, page-locked host memory for pinned
// Tier::host buffers, and the engine's element-wise work as kernels (kernels/cuda) on one
// compute stream. Downloads of finished collectives' outputs take a copy stream of their own,
// so they do not wait behind the kernels queued after them. Every call makes the engine's GPU
// current for its duration and restores the caller's.

#include <cuda_runtime_api.h>

#include <cstring>
#include <string>
#include <vector>

#include "kernels/cuda/cuda_kernels.hpp"
#include "base/cuda_check.hpp"
#include "src/cuda/device_communicator.hpp"
#include "src/compute/compute.hpp"
#include "src/cuda/cuda_resources.hpp"

namespace zeroshard {
namespace {

std::string mib(size_t bytes) {
  return std::to_string(bytes >> 20) + " MiB";
}

class DeviceMemory final : public Allocator {
 public:
  explicit DeviceMemory(int device) : device_(device) {}
  void* allocate(size_t bytes, const std::string& name) override {
    cuda::DeviceGuard guard(device_);
    void* p = nullptr;
    const cudaError_t e = cudaMalloc(&p, bytes);
    if (e == cudaErrorMemoryAllocation) {
      (void)cudaGetLastError();
      size_t free_b = 0, total_b = 0;
      (void)cudaMemGetInfo(&free_b, &total_b);
      ZS_THROW(no_space, "GPU " << device_ << ": cannot allocate " << mib(bytes) << " for " << name
                                << " (" << mib(free_b) << " free of " << mib(total_b)
                                << "); shard further (a higher stage or more ranks) or offload "
                                   "to the host or nvme tier");
    }
    ZS_CUDA_CHECK_CTX(e, "GPU " << device_ << ": allocating " << name);
    // Buffers start zeroed on every tier; allocation happens at finalize(), off the step path.
    // The zeroing must be done before any stream writes there: non-blocking streams do not
    // wait for the legacy stream it runs on.
    ZS_CUDA_CHECK(cudaMemset(p, 0, bytes));
    ZS_CUDA_CHECK(cudaStreamSynchronize(cudaStreamLegacy));
    return p;
  }
  void deallocate(void* p) noexcept override {
    int prev = -1;
    (void)cudaGetDevice(&prev);
    (void)cudaSetDevice(device_);
    (void)cudaFree(p);
    if (prev >= 0) (void)cudaSetDevice(prev);
  }

 private:
  int device_;
};

class PinnedMemory final : public Allocator {
 public:
  void* allocate(size_t bytes, const std::string& name) override {
    void* p = nullptr;
    const cudaError_t e = cudaHostAlloc(&p, bytes, cudaHostAllocPortable);
    if (e == cudaErrorMemoryAllocation) {
      (void)cudaGetLastError();
      ZS_THROW(no_space,
               "cannot allocate " << mib(bytes) << " of page-locked host memory for " << name);
    }
    ZS_CUDA_CHECK_CTX(e, "pinned host memory for " << name);
    std::memset(p, 0, bytes);
    return p;
  }
  void deallocate(void* p) noexcept override { (void)cudaFreeHost(p); }
};

class CudaCompute final : public Compute {
 public:
  explicit CudaCompute(int device)
      : device_(device),
        dev_mem_(device),
        own_(device),
        d2h_(device),
        workspace_(device, cuda::kSumSquaresWorkspaceBytes),
        sums_(device, 2 * sizeof(double)),
        host_sums_(2 * sizeof(double)) {
    stream_ = own_.get();
  }
  ~CudaCompute() override {
    // The engine synchronised its stream before freeing its buffers (Engine::~Engine); the
    // communicator outlives this, so it must not keep waiting on a stream about to go.
    for (DeviceCommunicator* c : device_comms_) c->set_input_stream(nullptr);
  }

  Device device() const override { return Device::cuda; }
  int device_index() const override { return device_; }
  Allocator* device_memory() override { return &dev_mem_; }
  Allocator* pinned_memory() override { return &pinned_; }

  void fill(void* p, unsigned char value, size_t bytes) override {
    cuda::DeviceGuard g(device_);
    if (bytes) ZS_CUDA_CHECK(cudaMemsetAsync(p, value, bytes, stream_));
  }
  void convert(const void* src, DType sd, void* dst, DType dd, int64_t n) override {
    cuda::DeviceGuard g(device_);
    if (n > 0 && !(src == dst && sd == dd)) cuda::convert(src, sd, dst, dd, n, stream_);
  }
  void accumulate(float* acc, const void* g, DType gd, int64_t n) override {
    cuda::DeviceGuard guard(device_);
    if (n > 0) cuda::accumulate(acc, g, gd, n, stream_);
  }
  void update(const std::vector<cpu::UpdateHyper>& hyper,
              const std::vector<UnitUpdate>& units) override {
    cuda::DeviceGuard g(device_);
    std::vector<cuda::UpdateRun> runs;
    for (const UnitUpdate& u : units) {  // one launch per unit
      runs.clear();
      for (const GroupRun& r : *u.runs) runs.push_back({r.begin, r.end, r.group});
      cuda::optimizer_update(hyper.data(), int(hyper.size()), runs.data(), int(runs.size()), u.args,
                             stream_);
    }
  }
  std::pair<double, bool> sum_squares(const std::vector<GradSpan>& spans) override {
    cuda::DeviceGuard g(device_);
    bool first = true;
    for (const GradSpan& s : spans) {
      if (s.n <= 0) continue;
      cuda::sum_squares_nonfinite(s.data, s.dtype, s.n, sums_.as<double>(), !first,
                                  workspace_.data(), stream_);
      first = false;
    }
    if (first) return {0.0, false};
    double* h = host_sums_.as<double>();
    ZS_CUDA_CHECK(
        cudaMemcpyAsync(h, sums_.data(), 2 * sizeof(double), cudaMemcpyDeviceToHost, stream_));
    ZS_CUDA_CHECK(cudaStreamSynchronize(stream_));
    return {h[0], h[1] != 0.0};
  }
  void copy(void* dst, const void* src, size_t bytes) override {
    cuda::DeviceGuard g(device_);
    if (bytes) ZS_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, stream_));
  }
  void download(void* host, const void* dev, size_t bytes) override {
    cuda::DeviceGuard g(device_);
    if (!bytes) return;
    ZS_CUDA_CHECK(cudaMemcpyAsync(host, dev, bytes, cudaMemcpyDeviceToHost, d2h_.get()));
    ZS_CUDA_CHECK(cudaStreamSynchronize(d2h_.get()));
  }
  void synchronize() override {
    cuda::DeviceGuard g(device_);
    ZS_CUDA_CHECK(cudaStreamSynchronize(stream_));
  }
  std::shared_ptr<void> register_host(void* p, size_t bytes) override {
    ZS_CUDA_CHECK_CTX(cudaHostRegister(p, bytes, cudaHostRegisterPortable),
                      "registering " << mib(bytes) << " of staging memory with CUDA");
    return std::shared_ptr<void>(p, [](void* q) { (void)cudaHostUnregister(q); });
  }

  std::shared_ptr<Communicator> adapt(std::shared_ptr<Communicator> comm) override {
    // A communicator that moves device memory itself (NCCL) is ordered with the compute stream on
    // the device; any other is wrapped to stage device buffers through host memory. An engine
    // with hierarchical sharding adapts its group communicators too.
    DeviceCommunicator* dc = as_device_communicator(comm.get());
    if (!dc) return stage_device_buffers(std::move(comm));
    if (dc->device() != device_)
      ZS_THROW(invalid_argument, "Engine: the NCCL communicator is on GPU "
                                     << dc->device() << " but the engine on GPU " << device_
                                     << " (zeroshard.device_index)");
    device_comms_.push_back(dc);
    return comm;
  }
  void before_collective() override {
    // NCCL waits for the compute stream on the device (set per call: engines may share the
    // communicator); any other backend reads device memory from the host (staged copies), so
    // the work that wrote it must be done.
    if (device_comms_.empty()) synchronize();
    for (DeviceCommunicator* c : device_comms_) c->set_input_stream(static_cast<void*>(stream_));
  }

  void* stream() const override { return static_cast<void*>(stream_); }
  void set_stream(void* s) override {
    synchronize();
    stream_ = s ? static_cast<cudaStream_t>(s) : own_.get();
  }

 private:
  int device_;
  DeviceMemory dev_mem_;
  PinnedMemory pinned_;
  cuda::Stream own_;                     // the engine's compute stream
  cudaStream_t stream_;                  // the one work is issued on: own_, or the trainer's
  cuda::Stream d2h_;                     // downloads of finished collectives' outputs
  cuda::DeviceBuffer workspace_, sums_;  // sum_squares_nonfinite's partials and result
  cuda::PinnedBuffer host_sums_;
  std::vector<DeviceCommunicator*> device_comms_;  // the engine's communicators that order by
                                                   // streams (NCCL's)
};

}  // namespace

std::unique_ptr<Compute> make_cuda_compute(int device, int local_rank) {
  std::string why;
  const int count = cuda::device_count(&why);
  if (count == 0) ZS_THROW(cuda_error, "zeroshard.device = cuda, but no GPU can be used: " << why);
  if (device < 0) device = local_rank % count;
  if (device >= count)
    ZS_THROW(invalid_config, "zeroshard.device_index = " << device << ", but this machine has "
                                                         << count << " GPU(s)");
  return std::make_unique<CudaCompute>(device);
}

}  // namespace zeroshard
