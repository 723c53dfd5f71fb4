#pragma once
// Device buffers through a host communicator: a Communicator decorator that lets the MPI
// communicator (which moves host memory only) carry buffers in a stream device's memory, by
// staging them through pinned host memory. Its purpose is testing stages 1–3 with several ranks
// on one GPU, which NCCL does not allow; it is not a fast path (two PCIe copies per buffer, and
// the collective itself runs on the CPU). Every line here is shared by the two devices that use
// it: the CUDA backend (src/cuda/cuda_staging.cpp: pointer classification and cudaMemcpy) and
// the asynchronous CPU device (src/compute/async_cpu_device.cpp), so the CPU suite runs this
// code on every multi-rank test of that device.
//
// Which buffers are staged. For reduce_scatter, all_gather, broadcast, all_reduce_sum and
// all_to_all, each buffer argument is classified by StagingDevice::device_of: device memory
// (CUDA: cudaMemoryTypeDevice, any device) is staged; host memory, pinned or pageable, and CUDA
// managed memory (which the host can address) go to the host communicator untouched. A call whose
// buffers are all host memory costs one classification per buffer and nothing else. Empty
// collectives (0 elements or bytes) are forwarded as they are. all_reduce takes host doubles and
// is forwarded unchanged, as are barrier, set_timeout, rank and size.
//
// Staging. A staged buffer gets a block of pinned host memory from a caching allocator owned by
// the decorator (so in steady state no call allocates pinned memory), sized like the argument:
//   - reduce_scatter: send (size() × recv_count elements) is copied in; recv is copied back.
//   - all_gather: send is copied in; recv (size() × send_count) is copied back. In place (send is
//     this rank's block of recv, in device memory): only that block is copied in, the host
//     collective runs in place on the staging block, and all of recv is copied back.
//   - broadcast: the root copies its data in; every rank copies the result back.
//   - all_to_all: each buffer is staged from its start to the end of its last piece; only the
//     send pieces are copied in, and only the received pieces back (what lies between them in
//     the device buffer stays as it was).
// One buffer may be staged and the other not (a host send with a device recv, for instance).
//
// Ordering contract.
//   - Input: the call copies each staged input to its staging block with a synchronous copy
//     (StagingDevice::to_host) from the calling thread, before handing the call to the host
//     communicator. On CUDA that is cudaMemcpy on the legacy default stream, which follows work
//     on blocking streams; a producer on a non-blocking stream must be synchronised before the
//     call (the engine synchronises its compute stream before starting a collective).
//   - Output: the result is copied back with a synchronous copy (StagingDevice::to_device) in
//     the thread that first observes the host collective's completion, in wait(), done() or
//     wait_settled(). Only then does done() return true or wait() return, so the result is
//     visible to the host and to any stream afterwards. The copy back happens once, under the
//     Work's mutex.
//   - A Work dropped before any thread saw it complete copies nothing back (the caller gave up
//     on the result; its buffer may already be freed).
//   - started_at() / finished_at() are the host collective's (the copies are not included).
//   - wait_settled(s) returns true only once the host communicator no longer touches the staging
//     and the copy back is done (or will never happen: the collective failed); it performs the
//     copy back itself if it is the first to see completion, and returns false if that cannot
//     happen within `s` seconds (another thread is still copying).
//
// Errors. The host communicator's errors (timeout, comm_failure, invalid_argument) propagate
// unchanged, and a failed collective copies nothing back (the device buffer keeps its old
// contents). A device failure (CUDA: Error(cuda_error)) throws an Error whose message names the
// collective
// ("rank 1: reduce_scatter of unit 'layer3': ..."): from the call itself when classifying or
// copying in fails (the collective is then not started on this rank, so its peers time out),
// from wait() when the copy back fails (done() still returns true; every later wait() throws
// the same error). Staging that runs out of pinned memory throws Error(no_space) from the call.
//
// Lifetime. The decorator holds `host_comm`. A Work keeps its staging blocks until the host
// collective has settled; a Work dropped while its collective is still unsettled (after a
// timeout) parks its blocks in the decorator's Quarantine (base/quarantine.hpp), since a
// late peer may still write into them: they return to the cache once the host collective
// settles, and only those still unsettled when the decorator and its Works are all gone are
// kept until the process ends.

#include <cstddef>
#include <memory>

#include "src/compute/caching_allocator.hpp"
#include "zeroshard/communicator.hpp"

namespace zeroshard {

/// What staging needs of a device whose memory the host communicator cannot move.
class StagingDevice {
 public:
  virtual ~StagingDevice() = default;
  /// The device index `p` lives on, or -1 for memory the host communicator moves as it is.
  virtual int device_of(const void* p) = 0;
  /// Synchronous copies between device memory of `device` and host memory, ordered after the
  /// work earlier issued on the device's blocking streams; they throw Error on failure.
  virtual void to_host(void* host, const void* dev, size_t bytes, int device) = 0;
  virtual void to_device(void* dev, const void* host, size_t bytes, int device) = 0;
  /// A caching allocator of pinned host memory that every device can copy with (`device` is
  /// the one that needs it now).
  virtual std::shared_ptr<CachingAllocator> pinned_allocator(int device) = 0;
};

/// Forwards every call to `host_comm` (non-null, kept alive by the result), staging the
/// buffers `dev` classifies as device memory through pinned host memory, as described above.
std::shared_ptr<Communicator> stage_through(std::shared_ptr<Communicator> host_comm,
                                            std::shared_ptr<StagingDevice> dev);

}  // namespace zeroshard
