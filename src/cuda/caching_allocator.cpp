// The CUDA backend of the caching allocator: one CUDA call per primitive (the bookkeeping is
// src/compute/caching_allocator.cpp).
#include "src/cuda/caching_allocator.hpp"

#include <cuda_runtime_api.h>

#include "base/cuda_check.hpp"
#include "src/cuda/cuda_resources.hpp"

namespace zeroshard::cuda {
namespace {

class CudaBlocks final : public CachingAllocator::Backend {
 public:
  CudaBlocks(CachingAllocator::Kind kind, int device) : kind_(kind), device_(device) {}

  void* alloc(size_t bytes) override {
    DeviceGuard guard(device_);
    void* p = nullptr;
    const cudaError_t e = kind_ == CachingAllocator::Kind::device
                              ? cudaMalloc(&p, bytes)
                              : cudaHostAlloc(&p, bytes, cudaHostAllocPortable);
    if (e == cudaErrorMemoryAllocation) {
      (void)cudaGetLastError();  // not sticky: clear it, the caller retries or says no_space
      return nullptr;
    }
    ZS_CUDA_CHECK_CTX(e, (kind_ == CachingAllocator::Kind::device ? "device" : "pinned host")
                             << " allocator (device " << device_ << ")");
    return p;
  }
  // Both frees wait for the device; they run only when the cache is trimmed or destroyed.
  void free(void* p) noexcept override {
    if (kind_ == CachingAllocator::Kind::device)
      (void)cudaFree(p);
    else
      (void)cudaFreeHost(p);
  }
  void* new_event() noexcept override {
    try {
      DeviceGuard guard(device_);  // an event records only on a stream of its own device
      cudaEvent_t e = nullptr;
      if (cudaEventCreateWithFlags(&e, cudaEventDisableTiming) != cudaSuccess) {
        (void)cudaGetLastError();
        return nullptr;
      }
      return static_cast<void*>(e);
    } catch (...) {
      return nullptr;  // the runtime is failing or shutting down; the caller copes
    }
  }
  void delete_event(void* e) noexcept override { (void)cudaEventDestroy(ev(e)); }
  bool record(void* e, void* stream) noexcept override {
    if (cudaEventRecord(ev(e), static_cast<cudaStream_t>(stream)) == cudaSuccess) return true;
    (void)cudaGetLastError();
    return false;
  }
  bool done(void* e) override {
    const cudaError_t q = cudaEventQuery(ev(e));
    if (q == cudaErrorNotReady) return false;
    ZS_CUDA_CHECK_CTX(q, "device allocator: a freed block's last use");
    return true;
  }
  void wait(void* e) noexcept override { (void)cudaEventSynchronize(ev(e)); }

 private:
  static cudaEvent_t ev(void* e) { return static_cast<cudaEvent_t>(e); }
  const CachingAllocator::Kind kind_;
  const int device_;
};

}  // namespace

std::shared_ptr<CachingAllocator> make_caching_allocator(CachingAllocator::Kind kind, int device) {
  return CachingAllocator::create(kind, device, std::make_unique<CudaBlocks>(kind, device));
}

}  // namespace zeroshard::cuda
