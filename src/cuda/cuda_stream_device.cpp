// The CUDA StreamDevice: device memory for Tier::device, page-locked host memory for pinned
// Tier::host buffers, streams and events, and the engine's element-wise work as kernels
// (kernels/cuda). Which stream each piece of work takes and where the host waits is decided once,
// for CUDA and the asynchronous CPU device alike, in src/compute/stream_compute.cpp: this file
// only translates those calls into CUDA's. Every call makes the engine's GPU current for its
// duration and restores the caller's.

#include <cuda_runtime_api.h>

#include <cstring>
#include <deque>
#include <string>
#include <vector>

#include "base/cuda_check.hpp"
#include "kernels/cuda/cuda_kernels.hpp"
#include "src/compute/compute.hpp"
#include "src/compute/device_communicator.hpp"
#include "src/compute/stream_device.hpp"
#include "src/cuda/cuda_resources.hpp"
#include "zeroshard/communicator.hpp"

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

class CudaStreamDevice final : public StreamDevice {
 public:
  explicit CudaStreamDevice(int device)
      : device_(device),
        dev_mem_(device),
        workspace_(device, cuda::kSumSquaresWorkspaceBytes),
        sums_(device, 2 * sizeof(double)),
        host_sums_(2 * sizeof(double)) {}
  ~CudaStreamDevice() override {
    if (!blas_) return;
    int prev = -1;
    (void)cudaGetDevice(&prev);
    (void)cudaSetDevice(device_);
    cuda::destroy_blas(blas_);
    if (prev >= 0) (void)cudaSetDevice(prev);
  }

  Device device() const override { return Device::cuda; }
  int device_index() const override { return device_; }
  Allocator* device_memory() override { return &dev_mem_; }
  Allocator* pinned_memory() override { return &pinned_; }
  std::shared_ptr<void> register_host(void* p, size_t bytes) override {
    ZS_CUDA_CHECK_CTX(cudaHostRegister(p, bytes, cudaHostRegisterPortable),
                      "registering " << mib(bytes) << " of staging memory with CUDA");
    // The registration ends once the device is idle: a copy queued from the memory may still
    // run (cudaFree waits so for device memory; cudaHostUnregister does not promise it).
    return std::shared_ptr<void>(p, [device = device_](void* q) {
      int prev = -1;
      (void)cudaGetDevice(&prev);
      (void)cudaSetDevice(device);
      (void)cudaDeviceSynchronize();
      (void)cudaHostUnregister(q);
      if (prev >= 0) (void)cudaSetDevice(prev);
    });
  }
  bool takes(const DeviceCommunicator& c) const override { return c.device() == device_; }
  std::shared_ptr<Communicator> carry(std::shared_ptr<Communicator> comm) override {
    return stage_device_buffers(std::move(comm));
  }

  Stream create_stream() override {
    streams_.emplace_back(device_);
    return streams_.back().handle();
  }
  void sync_stream(Stream s) override {
    cuda::DeviceGuard g(device_);
    ZS_CUDA_CHECK(cudaStreamSynchronize(cs(s)));
  }
  Stream adopt_stream(void* trainer_stream) override { return trainer_stream; }
  void* public_handle(Stream s) const override { return s; }

  void fill(void* p, unsigned char value, size_t bytes, Stream s) override {
    cuda::DeviceGuard g(device_);
    ZS_CUDA_CHECK(cudaMemsetAsync(p, value, bytes, cs(s)));
  }
  void copy(void* dst, const void* src, size_t bytes, Stream s) override {
    cuda::DeviceGuard g(device_);
    ZS_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, cs(s)));
  }
  void convert(const void* src, DType sd, void* dst, DType dd, int64_t n, Stream s) override {
    cuda::DeviceGuard g(device_);
    cuda::convert(src, sd, dst, dd, n, s);
  }
  void accumulate(float* acc, const void* grad, DType gd, int64_t n, Stream s) override {
    cuda::DeviceGuard g(device_);
    cuda::accumulate(acc, grad, gd, n, s);
  }
  void update(const std::vector<cpu::UpdateHyper>& hyper, const cpu::UnitUpdate& u,
              Stream s) override {
    cuda::DeviceGuard g(device_);
    runs_.clear();
    for (const GroupRun& r : *u.runs) runs_.push_back({r.begin, r.end, r.group});
    cuda::optimizer_update(hyper.data(), int(hyper.size()), runs_.data(), int(runs_.size()), u.args,
                           s);
  }
  void muon_average(const cpu::UpdateArgs& a, const cpu::UpdateHyper& h, int64_t lo, int64_t hi,
                    float* d, Stream s) override {
    cuda::DeviceGuard g(device_);
    cuda::muon_average(a, h, lo, hi, d, s);
  }
  // The iteration's norm has a workspace and sums of its own: the step's sum_squares() may
  // run on another stream.
  void newton_schulz(float* x, int64_t rows, int64_t cols, const cpu::NsOptions& o, float* scratch,
                     Stream s) override {
    cuda::DeviceGuard g(device_);
    if (!blas_) {
      blas_ = cuda::create_blas();
      ns_workspace_ = cuda::DeviceBuffer(device_, cuda::kSumSquaresWorkspaceBytes);
      ns_sums_ = cuda::DeviceBuffer(device_, 2 * sizeof(double));
    }
    cuda::newton_schulz(x, rows, cols, o, scratch, ns_sums_.as<double>(), ns_workspace_.data(),
                        blas_, s);
  }
  void sum_squares(const GradSpan& x, double* out, bool accumulate, Stream s) override {
    cuda::DeviceGuard g(device_);
    cuda::sum_squares_nonfinite(x.data, x.dtype, x.n, out, accumulate, workspace_.data(), s);
  }
  double* device_sums() override { return sums_.as<double>(); }
  double* host_sums() override { return host_sums_.as<double>(); }

 private:
  static cudaStream_t cs(Stream s) { return static_cast<cudaStream_t>(s); }

  int device_;
  DeviceMemory dev_mem_;
  PinnedMemory pinned_;
  std::deque<cuda::Stream> streams_;     // stable addresses; destroyed with the device
  cuda::DeviceBuffer workspace_, sums_;  // sum_squares_nonfinite's partials and result
  cuda::PinnedBuffer host_sums_;
  std::vector<cuda::UpdateRun> runs_;  // scratch of update(): one unit's runs
  void* blas_ = nullptr;               // newton_schulz()'s cuBLAS handle, made on first use
  cuda::DeviceBuffer ns_workspace_, ns_sums_;
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
  return make_stream_compute(std::make_unique<CudaStreamDevice>(device));
}

}  // namespace zeroshard
