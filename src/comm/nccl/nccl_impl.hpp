#pragma once
// The NCCL communicator's inside, shared by its two files: nccl_impl.cpp enqueues collectives and
// runs the watcher thread; nccl_communicator.cpp sets the communicator up, tears it down and
// checks the arguments of each collective.
//
// Collectives are enqueued in call order, by the calling thread under one mutex, on a dedicated
// high-priority communication stream; a CUDA event recorded after each marks its completion. A
// watcher thread polls those events, NCCL's asynchronous error state and every collective's
// deadline. The NCCL communicator is non-blocking (config.blocking = 0), so no NCCL call can wait
// forever: set-up and enqueue are polled with the same deadline, and a collective past its
// deadline gets ncclCommAbort (NCCL's way to stop kernels waiting on a peer) and an
// Error(timeout) naming it, as the MPI communicator does.

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "base/quarantine.hpp"
#include "src/comm/nccl/nccl_comm.hpp"
#include "src/comm/nccl/nccl_communicator.hpp"
#include "src/comm/work_state.hpp"
#include "src/cuda/caching_allocator.hpp"
#include "src/cuda/cuda_resources.hpp"

namespace zeroshard {

using NcclClock = std::chrono::steady_clock;

// NCCL set-up (unique id exchange and ncclCommInitRankConfig) fails after this long.
inline constexpr double kNcclInitTimeoutS = 300.0;
// At destruction, collectives that already failed get this long to settle before they are
// handed to the quarantine (see Impl::quarantine).
inline constexpr double kNcclAbandonAfterS = 5.0;
// Graceful teardown (ncclCommFinalize) gets this long before ncclCommAbort.
inline constexpr double kNcclFinalizeTimeoutS = 10.0;

NcclClock::time_point nccl_deadline_after(double seconds);

struct NcclCommunicator::Impl {
  int device = 0, rank = 0, size = 1;
  std::atomic<double> timeout_s{300.0};

  // Everything below up to list_mu is guarded by call_mu: it serialises every NCCL call on
  // `comm` (NCCL communicators are not thread-safe) and every enqueue on `stream`.
  std::mutex call_mu;
  NcclComm comm;  // empty once aborted or destroyed
  cuda::Stream stream;
  cudaStream_t input_stream = cudaStreamLegacy;
  // Re-recorded for every call: cudaStreamWaitEvent captures the record at its call, so one
  // event serves all calls.
  cuda::Event input_event;
  cuda::Event order_event;
  // Staging for host buffers (all_reduce, broadcast): cached, so no cudaMalloc per step.
  std::shared_ptr<cuda::CachingAllocator> dev_stage, host_stage;
  // Set by the watcher when it needs call_mu to abort: a caller polling an enqueue gives up.
  std::atomic<bool> abort_requested{false};

  struct InFlight {
    std::shared_ptr<WorkState> work;
    cuda::Event done;  // recorded on `stream` after the collective (and its copy back)
    NcclClock::time_point deadline;
    bool failed = false;   // already failed: waits only to settle
    void* user = nullptr;  // host buffer the staged result is copied back to
    size_t user_bytes = 0;
    cuda::CachingAllocator::Block host, dev;
  };
  // Collectives given up on at teardown, parked in the quarantine: once their events have
  // completed, their Works settle (their owners may then free the buffers) and the staging
  // returns to its allocator.
  struct Abandoned {
    std::vector<InFlight> list;
    bool settled() const noexcept;
    ~Abandoned();
  };
  std::mutex list_mu;
  std::condition_variable list_cv;
  std::vector<InFlight> inflight;  // guarded by list_mu
  cuda::EventPool events;          // guarded by list_mu
  bool stop = false;               // guarded by list_mu
  bool abandoned = false;          // set by the watcher as it gives up on failed work

  std::mutex state_mu;
  std::string poisoned;  // guarded by state_mu: why the communicator is unusable

  // Failed collectives that never settled (their stream waits behind a trainer's stream that
  // may never run again), with the staging and the stream they may still use: freeing those
  // could make cudaFree wait forever. Freed once they settle; see base/quarantine.hpp.
  Quarantine quarantine;

  std::thread watcher;

  // The communication stream and the staging allocators (nccl_communicator.cpp).
  void open();

  // ---- failure state (nccl_impl.cpp) ----
  void poison(const std::string& why);
  std::string poison_reason();
  // Aborts the NCCL communicator (kernels waiting on peers return) and fails every collective
  // still in flight; they settle once their events complete. Caller holds call_mu.
  void abort_locked(const std::string& reason) noexcept;

  // ---- enqueue (nccl_impl.cpp) ----
  struct Staging {
    void* user = nullptr;  // host buffer to stage through (all_reduce, broadcast); else null
    size_t bytes = 0;
  };
  // Enqueues the collective inside ncclGroupStart/End; it gets the staged device copy of a host
  // buffer (or nullptr).
  using Op = std::function<ncclResult_t(ncclComm_t, cudaStream_t, void* staged)>;
  std::shared_ptr<Work> submit(std::string what, Staging staging, const Op& op);
  // An empty collective moves nothing: it completes at once, without touching NCCL (whose
  // argument checks differ between versions for null buffers of zero elements).
  std::shared_ptr<Work> empty_work(const std::string& what);

  // ---- the watcher thread (nccl_impl.cpp) ----
  void watch();

  // ---- argument checks (nccl_communicator.cpp) ----
  void require_device(const void* p, const std::string& what, const char* name) const;

 private:
  cuda::Event take_event();
  void enqueue(InFlight& f, const Staging& staging, const Op& op, bool& enqueued);
  void wait_enqueued(const std::string& what, ncclResult_t rc, NcclClock::time_point deadline);
  bool settle_failed_submit(InFlight& f, const Error& e, bool enqueued) noexcept;
  void finish(InFlight& f, bool ok);
  bool poll_inflight(std::string& abort_reason, NcclClock::time_point& stop_seen);
  void check_async_error(NcclClock::time_point& last_check);
};

}  // namespace zeroshard
