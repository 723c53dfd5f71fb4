// The public GPU helpers of include/zeroshard/device.hpp. Built in every configuration: without
// CUDA (ZEROSHARD_HAVE_CUDA unset) there are no GPUs, device buffers cannot be made, and only
// CPU conversions run.

#include "zeroshard/device.hpp"

#include <utility>

#include "base/check.hpp"
#include "kernels/cpu/cpu_kernels.hpp"

#if defined(ZEROSHARD_HAVE_CUDA)
#include <cuda_runtime_api.h>

#include "base/cuda_check.hpp"
#include "kernels/cuda/cuda_kernels.hpp"
#include "src/cuda/cuda_resources.hpp"
#endif

namespace zeroshard {

#if defined(ZEROSHARD_HAVE_CUDA)

int cuda_device_count(std::string* why) noexcept {
  return cuda::device_count(why);
}

// Out of memory is reported as no_space (the tier is full), other failures as cuda_error.
DeviceBuffer::DeviceBuffer(int device, size_t bytes) : bytes_(bytes) {
  if (bytes == 0) return;
  cuda::DeviceGuard guard(device);
  const cudaError_t e = cudaMalloc(&ptr_, bytes);
  if (e == cudaErrorMemoryAllocation) {
    (void)cudaGetLastError();
    ZS_THROW(no_space, "cudaMalloc of " << bytes << " bytes on device " << device
                                        << " failed: out of device memory");
  }
  ZS_CUDA_CHECK(e);
}

void DeviceBuffer::reset() noexcept {
  if (ptr_) (void)cudaFree(ptr_);
  ptr_ = nullptr;
  bytes_ = 0;
}

#else

namespace {
constexpr const char* kNoCuda = "zeroshard was built without CUDA (ZEROSHARD_WITH_CUDA=OFF)";
}

int cuda_device_count(std::string* why) noexcept {
  if (why) *why = kNoCuda;
  return 0;
}

DeviceBuffer::DeviceBuffer(int device, size_t bytes) {
  if (bytes == 0) return;
  ZS_THROW(cuda_error, "DeviceBuffer(" << device << ", " << bytes << "): " << kNoCuda);
}

void DeviceBuffer::reset() noexcept {
  ptr_ = nullptr;
  bytes_ = 0;
}

#endif

DeviceBuffer::~DeviceBuffer() {
  reset();
}

DeviceBuffer::DeviceBuffer(DeviceBuffer&& o) noexcept
    : ptr_(std::exchange(o.ptr_, nullptr)), bytes_(std::exchange(o.bytes_, 0)) {}

DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&& o) noexcept {
  if (this != &o) {
    reset();
    ptr_ = std::exchange(o.ptr_, nullptr);
    bytes_ = std::exchange(o.bytes_, 0);
  }
  return *this;
}

void convert(const TensorView& src, const TensorView& dst, void* stream) {
  if (src.numel != dst.numel || src.numel < 0)
    ZS_THROW(invalid_argument,
             "convert: " << src.numel << " source and " << dst.numel << " destination elements");
  if (src.device != dst.device ||
      (src.device == Device::cuda && src.device_index != dst.device_index))
    ZS_THROW(invalid_argument, "convert: the source and the destination are on different devices");
  if (src.numel == 0 || (src.data == dst.data && src.dtype == dst.dtype)) return;
  if (src.device == Device::cpu) {
    cpu::convert(cpu::best_isa(), src.data, src.dtype, dst.data, dst.dtype, src.numel);
    return;
  }
#if defined(ZEROSHARD_HAVE_CUDA)
  cuda::DeviceGuard guard(src.device_index);
  cuda::convert(src.data, src.dtype, dst.data, dst.dtype, src.numel,
                stream != nullptr ? stream : static_cast<void*>(cudaStreamLegacy));
#else
  (void)stream;
  ZS_THROW(cuda_error, "convert of CUDA memory: " << kNoCuda);
#endif
}

}  // namespace zeroshard
