#include "src/cuda/cuda_resources.hpp"

#include <utility>

#include "base/cuda_check.hpp"

namespace zeroshard::cuda {

int device_count(std::string* why) noexcept {
  int n = 0;
  const cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess) {
    // Not fatal: this is how a machine without a GPU (or without a driver) answers. Clear the
    // error so later runtime calls do not report it again.
    (void)cudaGetLastError();
    if (why) *why = std::string(cudaGetErrorName(e)) + ": " + cudaGetErrorString(e);
    return 0;
  }
  if (n == 0 && why) *why = "the CUDA runtime reports 0 devices";
  return n;
}

DeviceGuard::DeviceGuard(int device) {
  ZS_CUDA_CHECK(cudaGetDevice(&previous_));
  if (previous_ != device) ZS_CUDA_CHECK(cudaSetDevice(device));
}

DeviceGuard::~DeviceGuard() {
  int now = -1;
  if (cudaGetDevice(&now) == cudaSuccess && now != previous_ && previous_ >= 0)
    (void)cudaSetDevice(previous_);
}

// ---- Stream ---------------------------------------------------------------------------------

Stream::Stream(int device, bool non_blocking, int priority) : device_(device) {
  DeviceGuard guard(device);
  ZS_CUDA_CHECK(cudaStreamCreateWithPriority(
      &stream_, non_blocking ? cudaStreamNonBlocking : cudaStreamDefault, priority));
}

Stream::~Stream() {
  reset();
}

// Moves leave the source empty, so exactly one owner destroys the handle.
Stream::Stream(Stream&& o) noexcept
    : stream_(std::exchange(o.stream_, nullptr)), device_(std::exchange(o.device_, -1)) {}

Stream& Stream::operator=(Stream&& o) noexcept {
  if (this != &o) {
    reset();
    stream_ = std::exchange(o.stream_, nullptr);
    device_ = std::exchange(o.device_, -1);
  }
  return *this;
}

void Stream::reset() noexcept {
  // Destroying a stream with work queued is allowed: the runtime frees it once the work is done.
  if (stream_) (void)cudaStreamDestroy(stream_);
  stream_ = nullptr;
}

void Stream::synchronize() const {
  ZS_CUDA_CHECK(cudaStreamSynchronize(stream_));
}

// ---- Event ----------------------------------------------------------------------------------

// Events without timing are cheaper to record and wait on; only benchmarks ask for timing.
Event::Event(bool timing) {
  ZS_CUDA_CHECK(
      cudaEventCreateWithFlags(&event_, timing ? cudaEventDefault : cudaEventDisableTiming));
}

Event::~Event() {
  reset();
}

Event::Event(Event&& o) noexcept : event_(std::exchange(o.event_, nullptr)) {}

Event& Event::operator=(Event&& o) noexcept {
  if (this != &o) {
    reset();
    event_ = std::exchange(o.event_, nullptr);
  }
  return *this;
}

void Event::reset() noexcept {
  if (event_) (void)cudaEventDestroy(event_);
  event_ = nullptr;
}

void Event::record(cudaStream_t stream) {
  ZS_CUDA_CHECK(cudaEventRecord(event_, stream));
}

void Event::wait_on(cudaStream_t stream) const {
  ZS_CUDA_CHECK(cudaStreamWaitEvent(stream, event_, 0));
}

// cudaErrorNotReady is the normal "still running" answer, not a failure.
bool Event::query() const {
  const cudaError_t e = cudaEventQuery(event_);
  if (e == cudaErrorNotReady) return false;
  ZS_CUDA_CHECK(e);
  return true;
}

void Event::synchronize() const {
  ZS_CUDA_CHECK(cudaEventSynchronize(event_));
}

float Event::elapsed_ms_since(const Event& start) const {
  float ms = 0;
  ZS_CUDA_CHECK(cudaEventElapsedTime(&ms, start.event_, event_));
  return ms;
}

Event EventPool::take() noexcept {
  if (!spare_.empty()) {
    Event e = std::move(spare_.back());
    spare_.pop_back();
    return e;
  }
  try {
    return Event(false);
  } catch (...) {
    return Event();  // the runtime is failing or shutting down; the caller copes
  }
}

void EventPool::give(Event e) noexcept {
  if (e.get() == nullptr) return;
  try {
    spare_.push_back(std::move(e));
  } catch (...) {
    // Out of host memory for the list: `e` is destroyed here instead.
  }
}

// ---- PinnedBuffer (DeviceBuffer is in device.cpp)
// ------------------------------------------------------------

// Portable: the pages are pinned for every device of the process, not only the current one.
PinnedBuffer::PinnedBuffer(size_t bytes) : bytes_(bytes) {
  if (bytes == 0) return;
  const cudaError_t e = cudaHostAlloc(&ptr_, bytes, cudaHostAllocPortable);
  if (e == cudaErrorMemoryAllocation) {
    (void)cudaGetLastError();
    ZS_THROW(no_space, "cudaHostAlloc of " << bytes
                                           << " pinned bytes failed: the system cannot "
                                              "page-lock that much memory");
  }
  ZS_CUDA_CHECK(e);
}

PinnedBuffer::~PinnedBuffer() {
  reset();
}

PinnedBuffer::PinnedBuffer(PinnedBuffer&& o) noexcept
    : ptr_(std::exchange(o.ptr_, nullptr)), bytes_(std::exchange(o.bytes_, 0)) {}

PinnedBuffer& PinnedBuffer::operator=(PinnedBuffer&& o) noexcept {
  if (this != &o) {
    reset();
    ptr_ = std::exchange(o.ptr_, nullptr);
    bytes_ = std::exchange(o.bytes_, 0);
  }
  return *this;
}

void PinnedBuffer::reset() noexcept {
  if (ptr_) (void)cudaFreeHost(ptr_);
  ptr_ = nullptr;
  bytes_ = 0;
}

// Since CUDA 11, plain host memory answers cudaMemoryTypeUnregistered instead of an error.
bool is_device_pointer(const void* p, int* device) {
  cudaPointerAttributes attr{};
  ZS_CUDA_CHECK(cudaPointerGetAttributes(&attr, p));
  const bool on_device = attr.type == cudaMemoryTypeDevice || attr.type == cudaMemoryTypeManaged;
  if (on_device && device) *device = attr.device;
  return on_device;
}

}  // namespace zeroshard::cuda
