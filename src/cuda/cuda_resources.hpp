#pragma once
// Move-only owners of CUDA runtime resources (docs/DESIGN.md rule 3): device guard, stream, event,
// device buffer and pinned host buffer. Constructors throw Error(cuda_error) (or no_space for
// an allocation that does not fit); destructors never throw and ignore errors, which at process
// exit are typically cudaErrorCudartUnloading. Internal header: it exposes CUDA types.

#include <cuda_runtime_api.h>

#include <cstddef>
#include <string>
#include <vector>

#include "zeroshard/device.hpp"

namespace zeroshard::cuda {

/// Number of usable CUDA devices; 0 when there is none or the driver/runtime cannot be
/// initialised, with the runtime's explanation in *why (if given). Never throws. (Public as
/// zeroshard::cuda_device_count.)
int device_count(std::string* why = nullptr) noexcept;

/// Makes `device` current on this thread for its lifetime, then restores the previous one, so a
/// library call never leaves the caller's thread on another device.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device);
  ~DeviceGuard();
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = -1;
};

/// A CUDA stream on one device. Non-blocking by default: it does not synchronise implicitly with
/// the legacy default stream, so ordering is always explicit (events), as docs/DESIGN.md rule 5
/// asks.
class Stream {
 public:
  Stream() = default;
  /// Lower `priority` numbers are higher priority (cudaDeviceGetStreamPriorityRange).
  Stream(int device, bool non_blocking = true, int priority = 0);
  ~Stream();
  Stream(Stream&& o) noexcept;
  Stream& operator=(Stream&& o) noexcept;
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;

  cudaStream_t get() const { return stream_; }
  /// The stream as the opaque handle the kernel launchers take (kernels/cuda/cuda_kernels.hpp).
  void* handle() const { return static_cast<void*>(stream_); }
  int device() const { return device_; }
  /// Blocks the calling thread until the stream's work is done (tests, benchmarks, teardown;
  /// the step path orders with events instead).
  void synchronize() const;

 private:
  void reset() noexcept;
  cudaStream_t stream_ = nullptr;
  int device_ = -1;
};

/// A CUDA event; without timing by default (cheaper to record and wait on).
class Event {
 public:
  Event() = default;
  explicit Event(bool timing);
  ~Event();
  Event(Event&& o) noexcept;
  Event& operator=(Event&& o) noexcept;
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;

  cudaEvent_t get() const { return event_; }
  void record(cudaStream_t stream);
  /// Makes `stream` wait (on the device, not the host) for the work this event captured.
  void wait_on(cudaStream_t stream) const;
  /// True once the captured work is done; throws Error(cuda_error) if it failed.
  bool query() const;
  void synchronize() const;
  /// Milliseconds between `start` and this event (both recorded with timing).
  float elapsed_ms_since(const Event& start) const;

 private:
  void reset() noexcept;
  cudaEvent_t event_ = nullptr;
};

/// Spare timing-free events, so that marking the last use of a block or a collective never
/// creates one in the step path: take() one, record it, give() it back once it completed (or
/// is no longer waited on). Owns every event it holds; they are destroyed with it. Not
/// thread-safe: its owner locks.
class EventPool {
 public:
  EventPool() = default;
  EventPool(EventPool&&) noexcept = default;
  EventPool& operator=(EventPool&&) noexcept = default;
  EventPool(const EventPool&) = delete;
  EventPool& operator=(const EventPool&) = delete;

  /// A spare event or a new one; an empty Event (get() null) if CUDA cannot create one.
  Event take() noexcept;
  /// Keeps `e` for reuse (destroys it if the pool cannot grow). Never throws.
  void give(Event e) noexcept;

 private:
  std::vector<Event> spare_;
};

/// cudaMalloc'ed bytes on one device: the public zeroshard::DeviceBuffer (device.hpp). For
/// buffers that live as long as an engine; per-step buffers come from CachingAllocator (no
/// cudaMalloc in the step path).
using DeviceBuffer = ::zeroshard::DeviceBuffer;

/// Page-locked host memory (cudaHostAlloc, portable): the source and target of asynchronous
/// host↔device copies, which from pageable memory would stage through a driver buffer and
/// serialise with the host.
class PinnedBuffer {
 public:
  PinnedBuffer() = default;
  explicit PinnedBuffer(size_t bytes);
  ~PinnedBuffer();
  PinnedBuffer(PinnedBuffer&& o) noexcept;
  PinnedBuffer& operator=(PinnedBuffer&& o) noexcept;
  PinnedBuffer(const PinnedBuffer&) = delete;
  PinnedBuffer& operator=(const PinnedBuffer&) = delete;

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

/// Where `p` lives, from cudaPointerGetAttributes: true for device or managed memory of any
/// device (then *device is set), false for host memory, pinned or not. Throws on a runtime error.
bool is_device_pointer(const void* p, int* device = nullptr);

}  // namespace zeroshard::cuda
