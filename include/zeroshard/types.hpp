#pragma once
/// \file types.hpp
/// Element types, devices, tiers and the non-owning tensor view that crosses the public API.

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "zeroshard/export.hpp"

namespace zeroshard {

/// Element type of a buffer. f32 is IEEE binary32, bf16 is the upper half of binary32,
/// f16 is IEEE binary16. All conversions to bf16/f16 round to nearest, ties to even.
enum class DType : uint8_t { f32, bf16, f16 };

/// Bytes per element of `t` (4 or 2). Inline: the kernels use it without the library.
inline size_t dtype_size(DType t) {
  return t == DType::f32 ? 4 : 2;
}
/// "f32", "bf16" or "f16".
ZS_API const char* dtype_name(DType t);

/// Where a buffer's memory lives. On a build without CUDA only `cpu` exists.
enum class Device : uint8_t { cpu, cuda };

/// Where a shard lives (docs/DESIGN.md "tiers"): `device` is the compute device's memory (ordinary
/// host memory on a CPU-only build), `host` is pinned host memory, `nvme` is swap files.
enum class Tier : uint8_t { device, host, nvme };
ZS_API const char* tier_name(Tier t);

/// One of the states a unit has, as Engine::read_shard() returns it: the low-precision
/// parameters, the f32 master weights, and the optimizer's moments.
enum class StateKind : uint8_t { param, master, state0, state1 };

/// A non-owning view of `numel` contiguous elements. The caller keeps `data` alive for as long
/// as the callee documents; the view never frees it.
struct TensorView {
  void* data = nullptr;
  int64_t numel = 0;
  DType dtype = DType::f32;
  Device device = Device::cpu;
  int device_index = 0;

  size_t bytes() const { return static_cast<size_t>(numel) * dtype_size(dtype); }
  template <class T>
  T* as() const {
    return static_cast<T*>(data);
  }
};

/// Number of elements of a shape (product of the extents; 1 for an empty shape).
ZS_API int64_t shape_numel(const std::vector<int64_t>& shape);
/// "[4, 5]" style rendering used in error messages.
ZS_API std::string shape_string(const std::vector<int64_t>& shape);

}  // namespace zeroshard
