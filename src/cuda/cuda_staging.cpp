// The CUDA side of staging device buffers through a host communicator (the shared code and its
// contract are in src/compute/staged_communicator.hpp): which pointers are device memory, the
// synchronous copies, and a caching allocator of portable pinned memory.

#include <cuda_runtime_api.h>

#include <memory>
#include <string>
#include <utility>

#include "base/check.hpp"
#include "src/compute/staged_communicator.hpp"
#include "src/cuda/caching_allocator.hpp"
#include "src/cuda/cuda_resources.hpp"

namespace zeroshard {
namespace {

// Throws Error(cuda_error) "<expr> failed: cudaErrorX: <description>" and clears the error, so
// a non-sticky failure here does not resurface in an unrelated later check.
void check_cuda(cudaError_t e, const char* expr) {
  if (e == cudaSuccess) return;
  (void)cudaGetLastError();
  ZS_THROW(cuda_error, expr << " failed: " << cudaGetErrorName(e) << ": " << cudaGetErrorString(e));
}

class CudaStaging final : public StagingDevice {
 public:
  // Memory of type cudaMemoryTypeDevice (cudaMalloc, any device); host memory, pinned or not,
  // and managed memory go to the host communicator as they are.
  int device_of(const void* p) override {
    if (p == nullptr) return -1;
    cudaPointerAttributes attr{};
    check_cuda(cudaPointerGetAttributes(&attr, p), "cudaPointerGetAttributes");
    return attr.type == cudaMemoryTypeDevice ? attr.device : -1;
  }
  // cudaMemcpy runs on the legacy default stream, after the work of blocking streams.
  void to_host(void* host, const void* dev, size_t bytes, int device) override {
    cuda::DeviceGuard guard(device);
    check_cuda(cudaMemcpy(host, dev, bytes, cudaMemcpyDeviceToHost),
               "cudaMemcpy(pinned staging, device, bytes, cudaMemcpyDeviceToHost)");
  }
  void to_device(void* dev, const void* host, size_t bytes, int device) override {
    cuda::DeviceGuard guard(device);
    check_cuda(cudaMemcpy(dev, host, bytes, cudaMemcpyHostToDevice),
               "cudaMemcpy(device, pinned staging, bytes, cudaMemcpyHostToDevice)");
  }
  // Portable pinned memory, usable with every device; `device` is only made current while it
  // allocates.
  std::shared_ptr<CachingAllocator> pinned_allocator(int device) override {
    return cuda::make_caching_allocator(CachingAllocator::Kind::pinned_host, device);
  }
};

}  // namespace

std::shared_ptr<Communicator> stage_device_buffers(std::shared_ptr<Communicator> host_comm) {
  ZS_CHECK(host_comm != nullptr);
  return stage_through(std::move(host_comm), std::make_shared<CudaStaging>());
}

}  // namespace zeroshard
