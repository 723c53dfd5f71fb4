#pragma once
// Where the engine's element-wise work runs and where its device tier lives: the CPU (the worker
// arena of kernels/cpu/arena.hpp; ordinary host memory plays the device, docs/DESIGN.md "tiers") or
// one CUDA GPU (kernels of kernels/cuda on a compute stream, device memory). The memory tiers are
// written once against this interface; the CPU implementation is the first-class CPU backend,
// not a mock.
//
// Ordering: work is issued in program order. On the CPU it is done when the call returns; on
// a GPU it is enqueued on the compute stream and done in that order, so a caller that reads
// device memory on the host (or reuses host memory a copy reads) calls synchronize() first.
// The asynchronous CPU device (Config::async_device, a testing device) runs the GPU's
// ordering on threads (stream_compute.cpp over async_cpu_device.cpp), with a seeded random delay
// before each piece of work, so a missing wait shows on machines without a GPU.

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "base/layout.hpp"
#include "base/ledger.hpp"
#include "kernels/cpu/arena.hpp"
#include "kernels/cpu/cpu_kernels.hpp"
#include "kernels/cpu/newton_schulz.hpp"
#include "kernels/cpu/update_tasks.hpp"
#include "src/compute/stream_device.hpp"
#include "zeroshard/types.hpp"

namespace zeroshard {

using cpu::UnitUpdate;

class Communicator;
struct Config;

class Compute {
 public:
  virtual ~Compute() = default;

  virtual Device device() const = 0;
  virtual int device_index() const = 0;  ///< 0 on the CPU
  /// Whether work runs later on streams and device memory is off the host's hands (a GPU, or
  /// the asynchronous CPU device playing one): the engine then takes the GPU's paths (staged
  /// tiers, copies up and down, waits); false for the synchronous CPU backend.
  virtual bool streams() const = 0;
  /// Memory of Tier::device buffers; null: the host heap.
  virtual Allocator* device_memory() = 0;
  /// Page-locked host memory the device reaches by DMA, for pinned Tier::host buffers; null:
  /// Buffer's own mlock'ed heap memory.
  virtual Allocator* pinned_memory() = 0;

  /// `bytes` bytes of `value` at p (device memory).
  virtual void fill(void* p, unsigned char value, size_t bytes) = 0;
  /// dst[i] = convert(src[i]), any dtypes (cpu::convert's rounding), device memory.
  virtual void convert(const void* src, DType src_dtype, void* dst, DType dst_dtype, int64_t n) = 0;
  /// acc[i] += float(g[i]), device memory.
  virtual void accumulate(float* acc, const void* g, DType g_dtype, int64_t n) = 0;
  /// The fused optimizer update of each unit (cpu::optimizer_update per element, bitwise the
  /// same on both backends), with hyper[run.group] for each run.
  virtual void update(const std::vector<cpu::UpdateHyper>& hyper,
                      const std::vector<UnitUpdate>& units) = 0;
  /// Muon (src/engine_muon.cpp), device memory: d[0, hi − lo) = the direction made from a's
  /// gradient and momentum over [lo, hi) of a's extent (cpu::muon_average), and a matrix
  /// orthogonalised in place (cpu::newton_schulz, then scaled: cpu::NsOptions) with
  /// cpu::newton_schulz_scratch() floats of device memory at `scratch`. The CPU
  /// backends run the CPU's kernels (OpenBLAS), the GPU cuBLAS: the same steps in f32, summed in
  /// another order, so the GPU's orthogonalisation is not bitwise the CPU's.
  virtual void muon_average(const cpu::UpdateArgs& a, const cpu::UpdateHyper& h, int64_t lo,
                            int64_t hi, float* d) = 0;
  virtual void newton_schulz(float* x, int64_t rows, int64_t cols, const cpu::NsOptions& o,
                             float* scratch) = 0;
  /// {Σ float(x)² in double over the spans (device memory), whether any element is inf or
  /// NaN}. Waits for the result. The CPU sums fixed chunks in index order; the GPU in its own
  /// fixed order (kernels/cuda/cuda_kernels.hpp): each is reproducible run to run.
  virtual std::pair<double, bool> sum_squares(const std::vector<GradSpan>& spans) = 0;
  /// bytes from src to dst, either in host or device memory, in issue order. Host memory it
  /// reads or writes must stay untouched until synchronize().
  virtual void copy(void* dst, const void* src, size_t bytes) = 0;
  /// Copies device memory that no issued work writes any more (a finished collective's output)
  /// to host memory, without waiting for the rest of the issued work; returns when it landed.
  virtual void download(void* host, const void* dev, size_t bytes) = 0;
  /// Blocks until every issued piece of work is done.
  virtual void synchronize() = 0;
  /// Called where the engine hands memory to the trainer (end of grads() and step()): the
  /// trainer's next work must follow what was issued. A GPU
  /// trainer's kernels follow on stream() (nothing to do); the asynchronous CPU device's
  /// trainer is the host thread, which waits here.
  virtual void hand_to_trainer() = 0;
  /// Makes host memory the device copies to and from by DMA (page-locked for the device) for as
  /// long as the returned handle lives; the memory must outlive the handle, whose end waits for
  /// the device's streams (a copy from the memory may still be queued). Null on the CPU.
  virtual std::shared_ptr<void> register_host(void* p, size_t bytes) = 0;

  /// The communicator the engine uses with this backend: `comm` itself, or on a GPU, `comm`
  /// made to take device memory (stage_device_buffers) unless it is NCCL's.
  virtual std::shared_ptr<Communicator> adapt(std::shared_ptr<Communicator> comm) = 0;
  /// Called before every collective on device memory, so that it follows the issued work: NCCL
  /// is told to wait for the compute stream on the device; for any other communicator the
  /// stream is synchronised (the staging copies run on the host's behalf).
  virtual void before_collective() = 0;

  /// The compute stream as an opaque handle (a cudaStream_t), null on the CPU.
  virtual void* stream() const = 0;
  /// Issue work on the trainer's stream from now on (null: the engine's own). Waits for the
  /// work issued so far first.
  virtual void set_stream(void* stream) = 0;
};

/// The CPU backend, on `arena`.
std::unique_ptr<Compute> make_cpu_compute(cpu::Arena& arena);
/// The GPU's ordering (stream_compute.cpp) over `device`.
std::unique_ptr<Compute> make_stream_compute(std::unique_ptr<StreamDevice> device);
/// How the asynchronous CPU device carries a host communicator's collectives on its memory: as a
/// GPU job with NCCL (nccl: on a stream of their own that follows the compute stream, with no
/// host wait; async_device_communicator.hpp) or with MPI (staged: through pinned staging after
/// the host waited for the compute stream; staged_communicator.hpp).
enum class AsyncComm { nccl, staged };
/// The asynchronous CPU device (async_cpu_device.cpp): kernels on `arena`, run by stream
/// threads; before each piece of work a stream sleeps a random 0..jitter_us microseconds drawn
/// from `seed`.
std::unique_ptr<Compute> make_async_cpu_compute(cpu::Arena& arena, uint64_t seed, int jitter_us,
                                                AsyncComm comm = AsyncComm::nccl);
/// A trainer's own stream on the asynchronous CPU device, for tests: work issued here runs on
/// a thread of its own, in issue order, after a seeded random delay of 0..jitter_us
/// microseconds, as a trainer's kernels run on its CUDA stream. handle() is what
/// Engine::set_stream() takes; the engine then queues its work on this stream and the trainer
/// queues its own after it, with no host wait between. It must outlive every engine it is
/// handed to, as a CUDA stream must. Destroying it finishes its work.
class AsyncTrainerStream {
 public:
  AsyncTrainerStream(uint64_t seed, int jitter_us);
  ~AsyncTrainerStream();
  AsyncTrainerStream(const AsyncTrainerStream&) = delete;
  AsyncTrainerStream& operator=(const AsyncTrainerStream&) = delete;
  void issue(std::function<void()> work);
  /// Blocks until the work issued so far is done; throws its first failure.
  void synchronize();
  void* handle() const { return handle_; }

 private:
  void* handle_;
};
/// The backend Config::device (and for cpu, Config::async_device) names. For cuda, device_index −1
/// picks the local rank (from the launcher's environment) modulo the number of GPUs. Throws
/// Error(invalid_config) for cuda in a build without CUDA, Error(cuda_error) when no GPU can be
/// used, with the runtime's reason.
std::unique_ptr<Compute> make_compute(const Config& cfg, cpu::Arena& arena);
/// Whether make_compute() makes the asynchronous CPU device: Config::async_device, overridden
/// by ZEROSHARD_ASYNC_DEVICE=1 or 0 (the test suite's switch: 1 takes every configuration a GPU
/// takes, the others stay on the synchronous CPU device); false for device cuda. Its
/// delays: ZEROSHARD_ASYNC_JITTER_US (most microseconds before each piece of work, default 50)
/// and ZEROSHARD_ASYNC_SEED (default 1; each rank adds its own); its collectives:
/// ZEROSHARD_ASYNC_COMM, nccl (default) or staged (AsyncComm).
bool async_device_selected(const Config& cfg);
#ifdef ZEROSHARD_HAVE_CUDA
/// GPU `device`, or (device < 0) GPU local_rank modulo the number of GPUs.
std::unique_ptr<Compute> make_cuda_compute(int device, int local_rank);
#endif

}  // namespace zeroshard
