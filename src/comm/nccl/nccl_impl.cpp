// The NCCL communicator's engine room: enqueueing collectives on the communication stream and
// the watcher thread that completes them, times them out and aborts NCCL on failure. The
// design is described in nccl_impl.hpp.

#include "src/comm/nccl/nccl_impl.hpp"

#include <cstring>
#include <optional>

#include "base/check.hpp"
#include "base/cuda_check.hpp"
#include "base/nccl_check.hpp"
#include "src/comm/seconds_text.hpp"
#include "src/comm/timeout.hpp"

namespace zeroshard {

NcclClock::time_point nccl_deadline_after(double seconds) {
  return NcclClock::now() + timeout_duration<NcclClock>(seconds);
}

// ---- failure state ------------------------------------------------------------------------

void NcclCommunicator::Impl::poison(const std::string& why) {
  std::lock_guard<std::mutex> lock(state_mu);
  if (poisoned.empty()) poisoned = why;
}

std::string NcclCommunicator::Impl::poison_reason() {
  std::lock_guard<std::mutex> lock(state_mu);
  return poisoned;
}

void NcclCommunicator::Impl::abort_locked(const std::string& reason) noexcept {
  poison(reason);
  comm.abort();
  std::lock_guard<std::mutex> lock(list_mu);
  for (InFlight& f : inflight) {
    if (f.failed) continue;
    f.work->fail(ErrorCode::comm_failure, f.work->what() + " aborted: " + reason);
    f.failed = true;
  }
}

// ---- enqueue ------------------------------------------------------------------------------

cuda::Event NcclCommunicator::Impl::take_event() {
  cuda::Event e;
  {
    std::lock_guard<std::mutex> lock(list_mu);
    e = events.take();
  }
  // The pool could not create one: try again, throwing CUDA's reason this time.
  return e.get() != nullptr ? std::move(e) : cuda::Event(false);
}

// Waits until a non-blocking NCCL call's work is enqueued (rc leaves ncclInProgress), within
// the collective's deadline. Caller holds call_mu.
void NcclCommunicator::Impl::wait_enqueued(const std::string& what, ncclResult_t rc,
                                           NcclClock::time_point deadline) {
  int polls = 0;
  while (rc == ncclInProgress) {
    if (NcclClock::now() > deadline) {
      const std::string msg =
          what + " could not start within " + seconds_text(timeout_s.load()) +
          " s (NCCL is still connecting to its peers: a peer rank is late, dead, "
          "or called a different collective); the NCCL communicator was aborted";
      abort_locked(msg);
      throw Error(ErrorCode::timeout, msg);
    }
    if (abort_requested.load())
      throw Error(ErrorCode::comm_failure, what + " abandoned: the communicator is being aborted");
    if (++polls > 64) std::this_thread::sleep_for(std::chrono::microseconds(50));
    rc = comm.async_state();
  }
  if (rc != ncclSuccess) {
    const std::string msg = what + " failed: " + nccl::error_string(rc, comm.get());
    abort_locked(msg);
    throw Error(ErrorCode::comm_failure, msg);
  }
}

// Queues the collective (with the staging copies around it) and the event that marks its end.
// `enqueued` becomes true as soon as the stream may touch the buffers. Caller holds call_mu.
void NcclCommunicator::Impl::enqueue(InFlight& f, const Staging& staging, const Op& op,
                                     bool& enqueued) {
  const cudaStream_t s = stream.get();
  input_event.record(input_stream);
  input_event.wait_on(s);
  void* staged = nullptr;
  if (staging.user != nullptr) {
    f.host = host_stage->allocate(staging.bytes);
    f.dev = dev_stage->allocate(staging.bytes, s);
    std::memcpy(f.host.data(), staging.user, staging.bytes);
    enqueued = true;
    ZS_CUDA_CHECK(
        cudaMemcpyAsync(f.dev.data(), f.host.data(), staging.bytes, cudaMemcpyHostToDevice, s));
    staged = f.dev.data();
    f.user = staging.user;
    f.user_bytes = staging.bytes;
  }
  ZS_NCCL_CHECK_CTX(comm_failure, comm.get(), ncclGroupStart(), f.work->what());
  enqueued = true;
  ncclResult_t op_rc = ncclSuccess;
  try {
    ZS_NCCL_CHECK_ASYNC(op_rc, comm_failure, comm.get(), op(comm.get(), s, staged),
                        f.work->what() << " could not be enqueued");
  } catch (...) {
    (void)ncclGroupEnd();  // the group is closed whatever happened inside it
    throw;
  }
  wait_enqueued(f.work->what(), ncclGroupEnd(), f.deadline);
  if (staging.user != nullptr)
    ZS_CUDA_CHECK(
        cudaMemcpyAsync(f.host.data(), f.dev.data(), staging.bytes, cudaMemcpyDeviceToHost, s));
  cuda::Event done = take_event();
  ZS_CUDA_CHECK(cudaEventRecord(done.get(), s));
  f.done = std::move(done);
}

// The stream's state is unknown after a failure in enqueue(), so the communicator is done for:
// abort it, fail this call, and settle it once the stream passes it (or now, if nothing was
// queued or no event can be recorded). Returns whether `f` must still be watched.
bool NcclCommunicator::Impl::settle_failed_submit(InFlight& f, const Error& e,
                                                  bool enqueued) noexcept {
  abort_locked(e.what());
  f.work->fail(e.code(), e.what());
  f.failed = true;
  if (enqueued && f.done.get() == nullptr) {
    cuda::Event ev;
    {
      std::lock_guard<std::mutex> lock(list_mu);
      ev = events.take();
    }
    if (ev.get() != nullptr && cudaEventRecord(ev.get(), stream.get()) == cudaSuccess)
      f.done = std::move(ev);
  }
  if (!enqueued || f.done.get() == nullptr) {
    (void)cudaGetLastError();
    f.work->settle();
    return false;
  }
  return true;
}

std::shared_ptr<Work> NcclCommunicator::Impl::submit(std::string what, Staging staging,
                                                     const Op& op) {
  auto work = std::make_shared<WorkState>("rank " + std::to_string(rank) + ": " + what);
  std::lock_guard<std::mutex> call(call_mu);
  if (const std::string why = poison_reason(); !why.empty() || !comm) {
    work->fail(ErrorCode::comm_failure, work->what() +
                                            " refused: the communicator is unusable after an "
                                            "earlier failure (" +
                                            why + ")");
    work->settle();
    return work;
  }
  InFlight f;
  f.work = work;
  work->mark_started();
  f.deadline = nccl_deadline_after(timeout_s.load());
  bool enqueued = false;                   // the stream may touch the buffers from here on
  std::optional<cuda::DeviceGuard> guard;  // for the whole call, the failure path included
  try {
    guard.emplace(device);
    enqueue(f, staging, op, enqueued);
  } catch (const Error& e) {
    if (!settle_failed_submit(f, e, enqueued)) return work;
  }
  {
    std::lock_guard<std::mutex> lock(list_mu);
    inflight.push_back(std::move(f));
  }
  list_cv.notify_all();
  return work;
}

std::shared_ptr<Work> NcclCommunicator::Impl::empty_work(const std::string& what) {
  auto work = std::make_shared<WorkState>("rank " + std::to_string(rank) + ": " + what);
  work->mark_started();
  work->complete();
  return work;
}

// ---- the watcher ----------------------------------------------------------------------------

// A collective's event completed (ok) or the device failed: copy a staged result back, free the
// staging and complete the Work, which settles it. Caller holds list_mu.
void NcclCommunicator::Impl::finish(InFlight& f, bool ok) {
  if (ok && f.user != nullptr && !f.work->failed())
    std::memcpy(f.user, f.host.data(), f.user_bytes);
  f.host.reset();
  f.dev.reset();
  events.give(std::move(f.done));
  f.work->complete();
}

bool NcclCommunicator::Impl::Abandoned::settled() const noexcept {
  for (const InFlight& f : list)
    if (f.done.get() != nullptr && cudaEventQuery(f.done.get()) == cudaErrorNotReady) return false;
  return true;
}

NcclCommunicator::Impl::Abandoned::~Abandoned() {
  for (InFlight& f : list) f.work->complete();
}

// One pass over the collectives in flight: completes the finished ones, fails those past their
// deadline and, when stopping, hands those that failed and never settle to the quarantine.
// Returns whether any finished. Caller holds list_mu.
bool NcclCommunicator::Impl::poll_inflight(std::string& abort_reason,
                                           NcclClock::time_point& stop_seen) {
  bool busy = false, all_failed = true;
  for (size_t i = 0; i < inflight.size();) {
    InFlight& f = inflight[i];
    const cudaError_t q = cudaEventQuery(f.done.get());
    if (q != cudaErrorNotReady) {
      if (q != cudaSuccess) {
        // The device failed under this collective (a sticky CUDA error): nothing on the stream
        // can run any more, so the buffers are as settled as they will get.
        (void)cudaGetLastError();
        const std::string msg = f.work->what() + " failed on the device: " + cudaGetErrorName(q) +
                                ": " + cudaGetErrorString(q);
        poison(msg);
        f.work->fail(ErrorCode::cuda_error, msg);
        if (abort_reason.empty()) abort_reason = msg;
      }
      finish(f, q == cudaSuccess);
      inflight.erase(inflight.begin() + std::ptrdiff_t(i));
      busy = true;
      continue;
    }
    if (!f.failed && NcclClock::now() > f.deadline) {
      const std::string msg = f.work->what() + " did not complete within " +
                              seconds_text(timeout_s.load()) +
                              " s (a peer rank is late, dead, or called a different collective); "
                              "the NCCL communicator was aborted";
      poison(msg);
      f.work->fail(ErrorCode::timeout, msg);
      f.failed = true;
      if (abort_reason.empty()) abort_reason = msg;
    }
    all_failed &= f.failed;
    ++i;
  }
  // At destruction, failed collectives that never settle are given up on after a grace period:
  // a kernel that may still run keeps its staging memory, in the quarantine.
  if (stop && !inflight.empty() && all_failed) {
    if (stop_seen == NcclClock::time_point{}) stop_seen = NcclClock::now();
    if (NcclClock::now() - stop_seen > std::chrono::duration<double>(kNcclAbandonAfterS)) {
      auto parked = std::make_shared<Abandoned>();
      parked->list = std::move(inflight);
      inflight.clear();
      quarantine.park([p = parked.get()] { return p->settled(); }, std::move(parked));
      abandoned = true;
    }
  }
  return busy;
}

// NCCL's asynchronous errors (a peer died, a network failure), about every millisecond, when no
// caller is inside an NCCL call.
void NcclCommunicator::Impl::check_async_error(NcclClock::time_point& last_check) {
  if (NcclClock::now() - last_check <= std::chrono::milliseconds(1)) return;
  last_check = NcclClock::now();
  std::unique_lock<std::mutex> call(call_mu, std::try_to_lock);
  if (!call.owns_lock() || !comm) return;
  const ncclResult_t state = comm.async_state();
  if (state != ncclSuccess && state != ncclInProgress)
    abort_locked("NCCL reported an asynchronous error: " + nccl::error_string(state, comm.get()));
}

void NcclCommunicator::Impl::watch() {
  (void)cudaSetDevice(device);
  NcclClock::time_point last_async_check = NcclClock::now();
  NcclClock::time_point stop_seen{};
  int idle = 0;
  for (;;) {
    std::string abort_reason;
    bool busy = false;
    try {
      std::unique_lock<std::mutex> lock(list_mu);
      if (inflight.empty()) {
        if (stop) return;
        list_cv.wait_for(lock, std::chrono::milliseconds(100));
        continue;
      }
      busy = poll_inflight(abort_reason, stop_seen);
      if (abandoned) return;
    } catch (...) {
      // Only host allocation can throw here; treat it as fatal for the communicator.
      if (abort_reason.empty()) abort_reason = "the watcher thread failed";
    }
    if (abort_reason.empty()) check_async_error(last_async_check);
    if (!abort_reason.empty()) {
      abort_requested.store(true);
      std::lock_guard<std::mutex> call(call_mu);
      abort_locked(abort_reason);
      abort_requested.store(false);
    }
    // Spin briefly (collectives tend to finish close together), then poll every 20 µs.
    if (busy) {
      idle = 0;
    } else if (++idle < 64) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(std::chrono::microseconds(20));
    }
  }
}

}  // namespace zeroshard
