#pragma once
/// \file device.hpp
/// GPU helpers for trainers that run their own kernels next to an engine on a GPU: how many GPUs
/// there are, device memory, and element type conversion with the engine's rounding. No CUDA
/// header is needed: device pointers are void*, streams are a cudaStream_t passed as void*.

#include <cstddef>
#include <string>

#include "zeroshard/export.hpp"
#include "zeroshard/types.hpp"

namespace zeroshard {

/// Number of usable CUDA devices; 0 when there is none, when the driver or runtime cannot be
/// initialised, or when zeroshard was built without CUDA, with the reason in *why (if given).
/// Never throws.
ZS_API int cuda_device_count(std::string* why = nullptr) noexcept;

/// `bytes` bytes of device memory (cudaMalloc: 256-byte aligned, uninitialised) on CUDA device
/// `device`, freed when destroyed. Move-only. Meant for buffers that live as long as a model; the
/// constructor synchronises like cudaMalloc does. Throws Error(no_space) when the device is out
/// of memory, Error(cuda_error) on other failures and in a build without CUDA. A zero-byte
/// buffer holds no memory (data() is null).
class ZS_API DeviceBuffer {
 public:
  DeviceBuffer() = default;
  DeviceBuffer(int device, size_t bytes);
  ~DeviceBuffer();
  DeviceBuffer(DeviceBuffer&& o) noexcept;
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  void* data() const { return ptr_; }
  template <class T>
  T* as() const {
    return static_cast<T*>(ptr_);
  }
  size_t bytes() const { return bytes_; }

 private:
  void reset() noexcept;
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};

/// dst[i] = src[i] converted from src.dtype to dst.dtype, for src.numel elements, rounding to
/// nearest even as the engine does (bitwise the same results on the CPU and the GPU; the same
/// dtype is a copy). Both views must have the same numel and live on the same device: CPU memory
/// (done before the call returns; `stream` is ignored) or the memory of one CUDA device (queued
/// on `stream`, a cudaStream_t; null is the legacy default stream). The ranges must not overlap
/// unless they are the same buffer with the same dtype. Throws Error(invalid_argument) naming
/// the mismatch, Error(cuda_error) if the launch fails or zeroshard was built without CUDA.
ZS_API void convert(const TensorView& src, const TensorView& dst, void* stream = nullptr);

}  // namespace zeroshard
