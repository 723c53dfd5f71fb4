#pragma once
// A device whose work runs later, on streams, in issue order: the few primitives the GPU
// backend needs from CUDA, behind one interface, so that everything above them (StreamCompute:
// which stream each piece of work goes on, where events order streams, when the host waits,
// how collectives follow the work that fills their buffers) is one piece of code shared by the
// CUDA backend (src/cuda/cuda_stream_device.cpp) and the asynchronous CPU device
// (async_cpu_device.cpp), which runs the same calls on threads and so proves their order on
// machines without a GPU.
//
// Every call that takes a Stream only enqueues: it returns before the work is done, and the
// memory it names must stay valid (host memory untouched) until the stream has reached it. A
// failure of enqueued work surfaces at the next sync_stream() of that stream. Streams are
// created by the device and live as long as it does. Freeing device or pinned memory waits for
// the work queued on every stream (as cudaFree and cudaFreeHost do). There are no events: the
// engine's two streams (compute, and downloads of finished collectives' outputs) share no
// buffer a stream writes, and the host waits where it needs a result.

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "base/ledger.hpp"
#include "kernels/cpu/cpu_kernels.hpp"
#include "kernels/cpu/newton_schulz.hpp"
#include "kernels/cpu/update_tasks.hpp"
#include "zeroshard/types.hpp"

namespace zeroshard {

class Communicator;
class DeviceCommunicator;

/// A stretch of gradient whose squares the step's norm sums.
struct GradSpan {
  const void* data = nullptr;
  DType dtype = DType::f32;
  int64_t n = 0;
};

class StreamDevice {
 public:
  using Stream = void*;  ///< opaque: a cudaStream_t, or one of the asynchronous CPU device's

  virtual ~StreamDevice() = default;

  /// Where its memory lives for TensorView (Device::cpu for the asynchronous CPU device, whose
  /// device memory is host memory that the engine treats as out of the host's reach).
  virtual Device device() const = 0;
  virtual int device_index() const = 0;
  /// Allocators of Tier::device buffers and of pinned Tier::host buffers; null: Buffer's own.
  virtual Allocator* device_memory() = 0;
  virtual Allocator* pinned_memory() = 0;
  /// See Compute::register_host().
  virtual std::shared_ptr<void> register_host(void* p, size_t bytes) = 0;
  /// `comm`, which moves host memory only, made to carry this device's buffers (see
  /// Compute::adapt()): staged through pinned host memory (staged_communicator.hpp), or, on the
  /// asynchronous CPU device by default, ordered on the device as NCCL orders collectives
  /// (async_device_communicator.hpp; the result is then a DeviceCommunicator).
  virtual std::shared_ptr<Communicator> carry(std::shared_ptr<Communicator> comm) = 0;
  /// Whether a communicator that moves device memory itself (an engine's NCCL communicator,
  /// handed to another engine too) moves this device's.
  virtual bool takes(const DeviceCommunicator& comm) const = 0;

  virtual Stream create_stream() = 0;
  /// Blocks the host until the work issued on `s` is done; throws the first failure of it.
  virtual void sync_stream(Stream s) = 0;

  /// A stream the trainer hands over (Engine::set_stream), as this device's Stream; throws
  /// Error(invalid_argument) where the device takes none.
  virtual Stream adopt_stream(void* trainer_stream) = 0;
  /// `s` as Engine::stream() reports it: a cudaStream_t, or null where the trainer has none.
  virtual void* public_handle(Stream s) const = 0;

  // Work on a stream: the element-wise kernels, bitwise the CPU backend's (compute.hpp).
  virtual void fill(void* p, unsigned char value, size_t bytes, Stream s) = 0;
  virtual void copy(void* dst, const void* src, size_t bytes, Stream s) = 0;
  virtual void convert(const void* src, DType sd, void* dst, DType dd, int64_t n, Stream s) = 0;
  virtual void accumulate(float* acc, const void* g, DType gd, int64_t n, Stream s) = 0;
  /// One unit's fused update; `hyper` and the runs are read at the call (the stream may run it
  /// later). No run is held (UpdateHyper::hold): StreamCompute converts those itself.
  virtual void update(const std::vector<cpu::UpdateHyper>& hyper, const cpu::UnitUpdate& unit,
                      Stream s) = 0;
  /// Muon's two kernels (Compute::muon_average(), Compute::newton_schulz()); the arguments are
  /// read at the call.
  virtual void muon_average(const cpu::UpdateArgs& a, const cpu::UpdateHyper& h, int64_t lo,
                            int64_t hi, float* d, Stream s) = 0;
  virtual void newton_schulz(float* x, int64_t rows, int64_t cols, const cpu::NsOptions& o,
                             float* scratch, Stream s) = 0;
  /// out[0] = Σ float(x)² (out[0] += with `accumulate`), out[1] = 1.0 once the sum or any
  /// element is not finite: two doubles of device memory (sums()).
  virtual void sum_squares(const GradSpan& x, double* out, bool accumulate, Stream s) = 0;
  /// Two doubles of device memory for sum_squares(), and two of host memory a copy can reach
  /// asynchronously, both owned by the device.
  virtual double* device_sums() = 0;
  virtual double* host_sums() = 0;
};

}  // namespace zeroshard
