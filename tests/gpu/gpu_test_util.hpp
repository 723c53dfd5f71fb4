#pragma once
// Shared by the GPU tests: the skip rule (no GPU → GTEST_SKIP with the CUDA runtime's reason,
// so CI without a GPU passes and says why), device arrays filled from and read back to host
// vectors, and the comparison "bitwise equal, or NaN on both sides".

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <bit>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "base/cuda_check.hpp"
#include "zeroshard/device.hpp"
#include "zeroshard/types.hpp"

namespace zs_gpu_test {

/// Empty when a CUDA GPU is usable, else why not ("no CUDA GPU on this machine: <cuda error>").
inline std::string gpu_skip_reason() {
  std::string why;
  if (zeroshard::cuda_device_count(&why) > 0) return {};
  return "no CUDA GPU on this machine: " + why;
}

/// First statement of every test that needs a GPU.
#define ZS_REQUIRE_GPU()                                                                \
  do {                                                                                  \
    if (const std::string zs_why_ = ::zs_gpu_test::gpu_skip_reason(); !zs_why_.empty()) \
      GTEST_SKIP() << zs_why_;                                                          \
  } while (0)

/// Bytes on device 0 (cudaMalloc'ed, so 256-byte aligned), with host round trips.
class DeviceBytes {
 public:
  explicit DeviceBytes(size_t bytes) : buf_(0, bytes == 0 ? 16 : bytes), bytes_(bytes) {}
  template <class T>
  explicit DeviceBytes(const std::vector<T>& host) : DeviceBytes(host.size() * sizeof(T)) {
    upload(host.data(), bytes_);
  }
  void upload(const void* src, size_t bytes) {
    if (bytes) ZS_CUDA_CHECK(cudaMemcpy(buf_.data(), src, bytes, cudaMemcpyHostToDevice));
  }
  template <class T>
  std::vector<T> download() const {
    std::vector<T> out(bytes_ / sizeof(T));
    if (bytes_) ZS_CUDA_CHECK(cudaMemcpy(out.data(), buf_.data(), bytes_, cudaMemcpyDeviceToHost));
    return out;
  }
  void* data() const { return buf_.data(); }
  template <class T>
  T* as() const {
    return static_cast<T*>(buf_.data());
  }

 private:
  zeroshard::DeviceBuffer buf_;
  size_t bytes_;
};

inline bool is_nan(zeroshard::DType d, const unsigned char* p) {
  if (d == zeroshard::DType::f32) {
    uint32_t u;
    std::memcpy(&u, p, 4);
    return (u & 0x7FFFFFFFu) > 0x7F800000u;
  }
  uint16_t h;
  std::memcpy(&h, p, 2);
  return d == zeroshard::DType::bf16 ? (h & 0x7FFFu) > 0x7F80u : (h & 0x7FFFu) > 0x7C00u;
}

/// Index of the first element of n where a and b differ in bits and are not both NaN; -1 if
/// none. (The GPU writes the canonical NaN where the CPU keeps a payload: both are NaN.)
inline int64_t first_mismatch(zeroshard::DType d, const void* a, const void* b, int64_t n) {
  const size_t es = zeroshard::dtype_size(d);
  auto* pa = static_cast<const unsigned char*>(a);
  auto* pb = static_cast<const unsigned char*>(b);
  for (int64_t i = 0; i < n; ++i) {
    const unsigned char* x = pa + size_t(i) * es;
    const unsigned char* y = pb + size_t(i) * es;
    if (std::memcmp(x, y, es) == 0) continue;
    if (is_nan(d, x) && is_nan(d, y)) continue;
    return i;
  }
  return -1;
}

}  // namespace zs_gpu_test
