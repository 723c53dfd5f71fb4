#pragma once
// NCCL's ordering on the asynchronous CPU device: a DeviceCommunicator over a host communicator,
// so that the CPU suite runs the engine's NCCL paths (stream_compute.cpp: collectives that follow
// the compute stream on the device, with no host wait before them) as a GPU job with NCCL runs
// them, and a wait that only NCCL needs is missed here too.
//
// Like the NCCL communicator (include/zeroshard/communicator.hpp, make_nccl_communicator):
//   - collectives run in call order on a stream of their own (a CpuStream, with the device's
//     jitter), over a communicator split off the host one, so no other caller's collectives
//     interleave with them;
//   - each first waits, on that stream, for the work queued on the input stream
//     (set_input_stream(), a CpuStream of the device) when it was called; with none set, for
//     nothing (the legacy default stream, which the engine's streams do not follow);
//   - reduce_scatter, all_gather and all_reduce_sum take device memory only (invalid_argument
//     otherwise, as NCCL's do); all_reduce and broadcast also take host memory, copied in at the
//     call and back when the collective completes;
//   - all_to_all takes device memory for the buffers it moves pieces of;
//   - a count of zero is no collective (an empty Work), a negative one is refused; an
//     all_to_all that moves nothing on this rank still runs (the host's is a collective);
//   - Work::done() is true once the collective ran (the results are then visible everywhere);
//     its timeout runs from the call, queued time included;
//   - order_before(stream) makes that stream wait for every collective called so far;
//   - split() waits for the collectives called before it.
// The host communicator's errors fail the Work (timeout, comm_failure); after a timeout the
// communicator is unusable (later collectives fail with comm_failure), as NCCL's is once
// aborted.

#include <cstdint>
#include <functional>
#include <memory>

#include "zeroshard/communicator.hpp"

namespace zeroshard {

class CpuStream;

/// What the communicator needs of the asynchronous CPU device.
struct AsyncCommHooks {
  /// Whether a pointer is the device's memory.
  std::function<bool(const void*)> is_device;
  /// Called with each communication stream made (split() makes more): the device's frees wait
  /// for them too, as cudaFree waits for NCCL's kernels.
  std::function<void(const std::shared_ptr<CpuStream>&)> enroll;
};

/// `host` (non-null) ordered as NCCL orders collectives, for the asynchronous CPU device; the
/// communication stream draws its delays from `seed` (0..jitter_us microseconds before each
/// collective). Collective over `host` (it splits off a communicator of the same ranks).
std::shared_ptr<Communicator> order_like_nccl(std::shared_ptr<Communicator> host,
                                              AsyncCommHooks hooks, uint64_t seed, int jitter_us);

}  // namespace zeroshard
