// The NCCL communicator. Collectives are enqueued in call order, by the calling thread under one
// mutex, on a dedicated high-priority communication stream; a CUDA event recorded after each
// marks its completion. A watcher thread polls those events, NCCL's asynchronous error state and
// every collective's deadline. The NCCL communicator is non-blocking (config.blocking = 0), so no
// NCCL call can wait forever: set-up and enqueue are polled with the same deadline, and a
// collective past its deadline gets ncclCommAbort (NCCL's way to stop kernels waiting on a peer)
// and an Error(timeout) naming it, as the MPI communicator does.

#include "src/comm/nccl/nccl_communicator.hpp"

#include <nccl.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <functional>
#include <mutex>
#include <optional>
#include <sstream>
#include <thread>
#include <vector>

#include "src/base/check.hpp"
#include "src/comm/work_state.hpp"
#include "src/cuda/caching_allocator.hpp"
#include "src/base/cuda_check.hpp"
#include "src/cuda/cuda_resources.hpp"

namespace zeroshard {
namespace {

using Clock = std::chrono::steady_clock;

// NCCL set-up (unique id exchange and ncclCommInitRankConfig) fails after this long.
constexpr double kInitTimeoutS = 300.0;
// At destruction, collectives that already failed get this long to settle before they are
// abandoned (left to the process's end with their buffers, as the MPI communicator does).
constexpr double kAbandonAfterS = 5.0;
// Graceful teardown (ncclCommFinalize) gets this long before ncclCommAbort.
constexpr double kFinalizeTimeoutS = 10.0;

Clock::time_point after(double seconds) {
  return Clock::now() +
         std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds));
}

std::string seconds_string(double s) {
  std::ostringstream os;
  os << s;
  return os.str();
}

std::string nccl_error(ncclResult_t rc, ncclComm_t comm) {
  std::string s = ncclGetErrorString(rc);
  const char* last = ncclGetLastError(comm);
  if (last != nullptr && *last != '\0') s += std::string(" (") + last + ")";
  return s;
}

ncclDataType_t nccl_type(DType t) {
  switch (t) {
    case DType::f32:
      return ncclFloat32;
    case DType::bf16:
      return ncclBfloat16;
    case DType::f16:
      return ncclFloat16;
  }
  return ncclFloat32;
}

ncclRedOp_t nccl_op(ReduceOp op) {
  switch (op) {
    case ReduceOp::sum:
      return ncclSum;
    case ReduceOp::max:
      return ncclMax;
    case ReduceOp::min:
      return ncclMin;
  }
  return ncclSum;
}

}  // namespace

struct NcclCommunicator::Impl {
  int device = 0, rank = 0, size = 1;
  std::atomic<double> timeout_s{300.0};

  // Everything below up to list_mu is guarded by call_mu: it serialises every NCCL call on
  // `comm` (NCCL communicators are not thread-safe) and every enqueue on `stream`.
  std::mutex call_mu;
  ncclComm_t comm = nullptr;  // null once aborted or destroyed
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
    cudaEvent_t done = nullptr;
    Clock::time_point deadline;
    bool failed = false;   // already failed: waits only to settle
    void* user = nullptr;  // host buffer the staged result is copied back to
    size_t user_bytes = 0;
    cuda::CachingAllocator::Block host, dev;
  };
  std::mutex list_mu;
  std::condition_variable list_cv;
  std::vector<InFlight> inflight;         // guarded by list_mu
  std::vector<cudaEvent_t> spare_events;  // guarded by list_mu
  bool stop = false;                      // guarded by list_mu
  bool abandoned = false;                 // set by the watcher as it gives up on failed work

  std::mutex state_mu;
  std::string poisoned;  // guarded by state_mu: why the communicator is unusable

  std::thread watcher;

  // ---- failure state --------------------------------------------------------------------

  void poison(const std::string& why) {
    std::lock_guard<std::mutex> lock(state_mu);
    if (poisoned.empty()) poisoned = why;
  }
  std::string poison_reason() {
    std::lock_guard<std::mutex> lock(state_mu);
    return poisoned;
  }

  // Aborts the NCCL communicator (kernels waiting on peers return) and fails every collective
  // still in flight; they settle once their events complete. Caller holds call_mu.
  void abort_locked(const std::string& reason) noexcept {
    poison(reason);
    if (comm != nullptr) {
      (void)ncclCommAbort(comm);
      comm = nullptr;
    }
    std::lock_guard<std::mutex> lock(list_mu);
    for (InFlight& f : inflight) {
      if (f.failed) continue;
      f.work->fail(ErrorCode::comm_failure, f.work->what() + " aborted: " + reason);
      f.failed = true;
    }
  }

  // ---- enqueue --------------------------------------------------------------------------

  cudaEvent_t take_event() {
    {
      std::lock_guard<std::mutex> lock(list_mu);
      if (!spare_events.empty()) {
        cudaEvent_t e = spare_events.back();
        spare_events.pop_back();
        return e;
      }
    }
    cudaEvent_t e = nullptr;
    ZS_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    return e;
  }

  // Waits until a non-blocking NCCL call's work is enqueued (rc leaves ncclInProgress), within
  // the collective's deadline. Caller holds call_mu.
  void wait_enqueued(const std::string& what, ncclResult_t rc, Clock::time_point deadline) {
    int polls = 0;
    while (rc == ncclInProgress) {
      if (Clock::now() > deadline) {
        const std::string msg =
            what + " could not start within " + seconds_string(timeout_s.load()) +
            " s (NCCL is still connecting to its peers: a peer rank is late, dead, "
            "or called a different collective); the NCCL communicator was aborted";
        abort_locked(msg);
        throw Error(ErrorCode::timeout, msg);
      }
      if (abort_requested.load())
        throw Error(ErrorCode::comm_failure,
                    what + " abandoned: the communicator is being aborted");
      if (++polls > 64) std::this_thread::sleep_for(std::chrono::microseconds(50));
      ncclResult_t state = ncclSuccess;
      const ncclResult_t q = ncclCommGetAsyncError(comm, &state);
      rc = q != ncclSuccess ? q : state;
    }
    if (rc != ncclSuccess) {
      const std::string msg = what + " failed: " + nccl_error(rc, comm);
      abort_locked(msg);
      throw Error(ErrorCode::comm_failure, msg);
    }
  }

  struct Staging {
    void* user = nullptr;  // host buffer to stage through (all_reduce, broadcast); else null
    size_t bytes = 0;
  };
  // Enqueues the collective `op` inside ncclGroupStart/End; `op` gets the staged device copy
  // of a host buffer (or nullptr).
  using Op = std::function<ncclResult_t(ncclComm_t, cudaStream_t, void* staged)>;

  std::shared_ptr<Work> submit(std::string what, Staging staging, const Op& op) {
    auto work = std::make_shared<WorkState>("rank " + std::to_string(rank) + ": " + what);
    std::lock_guard<std::mutex> call(call_mu);
    if (const std::string why = poison_reason(); !why.empty() || comm == nullptr) {
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
    f.deadline = after(timeout_s.load());
    bool enqueued = false;                   // the stream may touch the buffers from here on
    std::optional<cuda::DeviceGuard> guard;  // for the whole call, the failure path included
    try {
      guard.emplace(device);
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
      const ncclResult_t start = ncclGroupStart();
      if (start != ncclSuccess)
        throw Error(ErrorCode::comm_failure,
                    work->what() + ": ncclGroupStart failed: " + nccl_error(start, comm));
      enqueued = true;
      const ncclResult_t op_rc = op(comm, s, staged);
      const ncclResult_t end = ncclGroupEnd();
      if (op_rc != ncclSuccess && op_rc != ncclInProgress) {
        const std::string msg = work->what() + " could not be enqueued: " + nccl_error(op_rc, comm);
        abort_locked(msg);
        throw Error(ErrorCode::comm_failure, msg);
      }
      wait_enqueued(work->what(), end, f.deadline);
      if (staging.user != nullptr)
        ZS_CUDA_CHECK(
            cudaMemcpyAsync(f.host.data(), f.dev.data(), staging.bytes, cudaMemcpyDeviceToHost, s));
      f.done = take_event();
      ZS_CUDA_CHECK(cudaEventRecord(f.done, s));
    } catch (const Error& e) {
      // The stream's state is unknown after a failure here, so the communicator is done for:
      // abort it, fail this call, and settle it once the stream passes it (or now, if nothing
      // was queued or no event can be recorded).
      abort_locked(e.what());
      work->fail(e.code(), e.what());
      f.failed = true;
      if (enqueued && f.done == nullptr) {
        cudaEvent_t ev = nullptr;
        if (cudaEventCreateWithFlags(&ev, cudaEventDisableTiming) == cudaSuccess &&
            cudaEventRecord(ev, stream.get()) == cudaSuccess) {
          f.done = ev;
        } else if (ev != nullptr) {
          (void)cudaEventDestroy(ev);
        }
      }
      if (!enqueued || f.done == nullptr) {
        (void)cudaGetLastError();
        work->settle();
        return work;
      }
    }
    {
      std::lock_guard<std::mutex> lock(list_mu);
      inflight.push_back(std::move(f));
    }
    list_cv.notify_all();
    return work;
  }

  // ---- the watcher ----------------------------------------------------------------------

  // A collective's event completed (ok) or the device failed: copy a staged result back, free
  // the staging and complete the Work, which settles it. Caller holds list_mu.
  void finish(InFlight& f, bool ok) {
    if (ok && f.user != nullptr && !f.work->failed())
      std::memcpy(f.user, f.host.data(), f.user_bytes);
    f.host.reset();
    f.dev.reset();
    if (f.done != nullptr) spare_events.push_back(f.done);
    f.done = nullptr;
    f.work->complete();
  }

  void watch() {
    (void)cudaSetDevice(device);
    Clock::time_point last_async_check = Clock::now();
    Clock::time_point stop_seen{};
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
        bool all_failed = true;
        for (size_t i = 0; i < inflight.size();) {
          InFlight& f = inflight[i];
          const cudaError_t q = cudaEventQuery(f.done);
          if (q == cudaSuccess || q != cudaErrorNotReady) {
            if (q != cudaSuccess) {
              // The device failed under this collective (a sticky CUDA error): nothing on the
              // stream can run any more, so the buffers are as settled as they will get.
              (void)cudaGetLastError();
              const std::string msg = f.work->what() +
                                      " failed on the device: " + cudaGetErrorName(q) + ": " +
                                      cudaGetErrorString(q);
              poison(msg);
              f.work->fail(ErrorCode::cuda_error, msg);
              if (abort_reason.empty()) abort_reason = msg;
            }
            finish(f, q == cudaSuccess);
            inflight.erase(inflight.begin() + std::ptrdiff_t(i));
            busy = true;
            continue;
          }
          if (!f.failed && Clock::now() > f.deadline) {
            const std::string msg =
                f.work->what() + " did not complete within " + seconds_string(timeout_s.load()) +
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
        // At destruction, failed collectives that never settle are abandoned after a grace period.
        if (stop && !inflight.empty() && all_failed) {
          if (stop_seen == Clock::time_point{}) stop_seen = Clock::now();
          if (Clock::now() - stop_seen > std::chrono::duration<double>(kAbandonAfterS)) {
            // Deliberately leaked: a kernel that may still run keeps its staging memory.
            new std::vector<InFlight>(std::move(inflight));
            inflight.clear();
            abandoned = true;
            return;
          }
        }
      } catch (...) {
        // Only host allocation can throw here; treat it as fatal for the communicator.
        if (abort_reason.empty()) abort_reason = "the watcher thread failed";
      }
      // NCCL's asynchronous errors (a peer died, a network failure), about every millisecond,
      // when no caller is inside an NCCL call.
      if (abort_reason.empty() && Clock::now() - last_async_check > std::chrono::milliseconds(1)) {
        last_async_check = Clock::now();
        std::unique_lock<std::mutex> call(call_mu, std::try_to_lock);
        if (call.owns_lock() && comm != nullptr) {
          ncclResult_t state = ncclSuccess;
          const ncclResult_t q = ncclCommGetAsyncError(comm, &state);
          if (q != ncclSuccess) state = q;
          if (state != ncclSuccess && state != ncclInProgress)
            abort_locked("NCCL reported an asynchronous error: " + nccl_error(state, comm));
        }
      }
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

  // An empty collective moves nothing: it completes at once, without touching NCCL (whose
  // argument checks differ between versions for null buffers of zero elements).
  std::shared_ptr<Work> empty_work(const std::string& what) {
    auto work = std::make_shared<WorkState>("rank " + std::to_string(rank) + ": " + what);
    work->mark_started();
    work->complete();
    return work;
  }

  // ---- argument checks ------------------------------------------------------------------

  void require_device(const void* p, const std::string& what, const char* name) const {
    int dev = -1;
    if (!cuda::is_device_pointer(p, &dev))
      ZS_THROW(invalid_argument, "rank " << rank << ": " << what << ": " << name << " (" << p
                                         << ") is not device memory; the NCCL communicator moves "
                                            "buffers of CUDA device "
                                         << device
                                         << " (use make_mpi_communicator() for host buffers)");
    if (dev != device)
      ZS_THROW(invalid_argument, "rank " << rank << ": " << what << ": " << name
                                         << " is memory of CUDA device " << dev
                                         << ", but this communicator runs on device " << device);
  }
};

// ---- construction and teardown ----------------------------------------------------------------

NcclCommunicator::NcclCommunicator(int device, Communicator& bootstrap)
    : impl_(std::make_unique<Impl>()) {
  Impl& m = *impl_;
  m.device = device;
  m.rank = bootstrap.rank();
  m.size = bootstrap.size();
  const std::string who =
      "rank " + std::to_string(m.rank) + ": make_nccl_communicator(" + std::to_string(device) + ")";

  // 1. Every rank checks its device, and all learn whether every rank can go on, so no rank
  //    waits in NCCL's set-up for a peer that already gave up.
  std::string why;
  const int count = cuda::device_count(&why);
  std::string local_error;
  if (count == 0) {
    local_error = who + ": no CUDA device: " + why;
  } else if (device < 0 || device >= count) {
    local_error = who + ": device " + std::to_string(device) +
                  " does not exist (this process sees " + std::to_string(count) + ")";
  }
  double ok = local_error.empty() ? 1.0 : 0.0;
  bootstrap.all_reduce(&ok, 1, ReduceOp::min, "NCCL set-up (device check)")->wait();
  if (!local_error.empty()) ZS_THROW(cuda_error, local_error);
  if (ok == 0.0) ZS_THROW(cuda_error, who << ": another rank has no usable CUDA device");

  // 2. Rank 0 creates the unique id; the broadcast carries it or rank 0's failure.
  struct IdMessage {
    int32_t ok;
    char reason[252];
    ncclUniqueId id;
  } msg{};
  cuda::DeviceGuard guard(device);
  if (m.rank == 0) {
    const ncclResult_t rc = ncclGetUniqueId(&msg.id);
    msg.ok = rc == ncclSuccess ? 1 : 0;
    if (rc != ncclSuccess)
      std::snprintf(msg.reason, sizeof msg.reason, "%s", ncclGetErrorString(rc));
  }
  bootstrap.broadcast(&msg, int64_t(sizeof msg), 0, "NCCL set-up (unique id)")->wait();
  if (msg.ok == 0)
    ZS_THROW(cuda_error, who << ": ncclGetUniqueId failed on rank 0: " << msg.reason);

  // 3. The communication stream (highest priority, so collectives are not starved by compute
  //    kernels), the staging allocators, and the non-blocking NCCL communicator.
  int least = 0, greatest = 0;
  ZS_CUDA_CHECK(cudaDeviceGetStreamPriorityRange(&least, &greatest));
  m.stream = cuda::Stream(device, true, greatest);
  m.input_event = cuda::Event(false);
  m.order_event = cuda::Event(false);
  m.dev_stage = cuda::CachingAllocator::create(cuda::CachingAllocator::Kind::device, device);
  m.host_stage = cuda::CachingAllocator::create(cuda::CachingAllocator::Kind::pinned_host, device);

  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  std::string init_error;
  ErrorCode init_code = ErrorCode::cuda_error;
  ncclResult_t rc = ncclCommInitRankConfig(&m.comm, m.size, msg.id, m.rank, &config);
  const auto deadline = after(kInitTimeoutS);
  int polls = 0;
  while (rc == ncclInProgress && m.comm != nullptr) {
    if (Clock::now() > deadline) {
      init_code = ErrorCode::timeout;
      init_error = who + ": ncclCommInitRankConfig did not complete within " +
                   seconds_string(kInitTimeoutS) + " s (a peer rank is late or dead)";
      break;
    }
    if (++polls > 64) std::this_thread::sleep_for(std::chrono::microseconds(200));
    ncclResult_t state = ncclSuccess;
    const ncclResult_t q = ncclCommGetAsyncError(m.comm, &state);
    rc = q != ncclSuccess ? q : state;
  }
  if (init_error.empty() && rc != ncclSuccess)
    init_error = who + ": ncclCommInitRankConfig failed: " + nccl_error(rc, m.comm);
  // 4. All ranks agree on the outcome, so none keeps a communicator its peers threw away.
  double init_ok = init_error.empty() ? 1.0 : 0.0;
  bootstrap.all_reduce(&init_ok, 1, ReduceOp::min, "NCCL set-up (status)")->wait();
  if (!init_error.empty() || init_ok == 0.0) {
    if (m.comm != nullptr) (void)ncclCommAbort(m.comm);
    m.comm = nullptr;
    if (!init_error.empty()) throw Error(init_code, init_error);
    ZS_THROW(cuda_error, who << ": NCCL set-up failed on another rank");
  }
  m.watcher = std::thread([&m] { m.watch(); });
}

NcclCommunicator::~NcclCommunicator() {
  Impl& m = *impl_;
  {
    std::lock_guard<std::mutex> lock(m.list_mu);
    m.stop = true;
  }
  m.list_cv.notify_all();
  if (m.watcher.joinable()) m.watcher.join();
  std::lock_guard<std::mutex> call(m.call_mu);
  if (m.comm != nullptr) {
    (void)cudaSetDevice(m.device);
    bool clean = !m.abandoned && m.poison_reason().empty();
    if (clean) {
      // Graceful: flush, wait (bounded) for NCCL to quiesce, then free.
      ncclResult_t rc = ncclCommFinalize(m.comm);
      const auto deadline = after(kFinalizeTimeoutS);
      while (rc == ncclInProgress && Clock::now() < deadline) {
        std::this_thread::sleep_for(std::chrono::microseconds(200));
        ncclResult_t state = ncclSuccess;
        const ncclResult_t q = ncclCommGetAsyncError(m.comm, &state);
        rc = q != ncclSuccess ? q : state;
      }
      clean = rc == ncclSuccess && ncclCommDestroy(m.comm) == ncclSuccess;
    }
    if (!clean) (void)ncclCommAbort(m.comm);
    m.comm = nullptr;
  }
  {
    std::lock_guard<std::mutex> lock(m.list_mu);
    for (cudaEvent_t e : m.spare_events) (void)cudaEventDestroy(e);
    m.spare_events.clear();
  }
  if (m.abandoned) {
    // Abandoned collectives may still hold the staging allocators' memory; keep them (and the
    // stream their kernels may run on) alive until the process ends rather than free under them.
    new std::shared_ptr<cuda::CachingAllocator>(std::move(m.dev_stage));
    new std::shared_ptr<cuda::CachingAllocator>(std::move(m.host_stage));
    new cuda::Stream(std::move(m.stream));
  }
}

// ---- collectives ------------------------------------------------------------------------------

int NcclCommunicator::rank() const {
  return impl_->rank;
}
int NcclCommunicator::size() const {
  return impl_->size;
}
int NcclCommunicator::device() const {
  return impl_->device;
}
cudaStream_t NcclCommunicator::comm_stream() const {
  return impl_->stream.get();
}

void NcclCommunicator::set_timeout(double seconds) {
  impl_->timeout_s.store(seconds);
}

void NcclCommunicator::set_input_stream(cudaStream_t stream) {
  std::lock_guard<std::mutex> call(impl_->call_mu);
  impl_->input_stream = stream == nullptr ? cudaStreamLegacy : stream;
}

void NcclCommunicator::order_before(cudaStream_t stream) {
  Impl& m = *impl_;
  std::lock_guard<std::mutex> call(m.call_mu);
  cuda::DeviceGuard guard(m.device);
  m.order_event.record(m.stream.get());
  m.order_event.wait_on(stream);
}

std::shared_ptr<Work> NcclCommunicator::reduce_scatter(const void* send, void* recv,
                                                       int64_t recv_count, DType dtype,
                                                       std::string what) {
  Impl& m = *impl_;
  const std::string name = "reduce_scatter of " + what;
  if (recv_count < 0)
    ZS_THROW(invalid_argument,
             "rank " << m.rank << ": " << name << ": negative count " << recv_count);
  if (recv_count == 0) return m.empty_work(name);
  m.require_device(send, name, "send");
  m.require_device(recv, name, "recv");
  const size_t n = size_t(recv_count);
  return m.submit(name, {}, [=](ncclComm_t c, cudaStream_t s, void*) {
    return ncclReduceScatter(send, recv, n, nccl_type(dtype), ncclSum, c, s);
  });
}

std::shared_ptr<Work> NcclCommunicator::all_gather(const void* send, void* recv, int64_t send_count,
                                                   DType dtype, std::string what) {
  Impl& m = *impl_;
  const std::string name = "all_gather of " + what;
  if (send_count < 0)
    ZS_THROW(invalid_argument,
             "rank " << m.rank << ": " << name << ": negative count " << send_count);
  if (send_count == 0) return m.empty_work(name);
  m.require_device(send, name, "send");
  m.require_device(recv, name, "recv");
  // NCCL handles the in-place case (send == this rank's block of recv) itself.
  const size_t n = size_t(send_count);
  return m.submit(name, {}, [=](ncclComm_t c, cudaStream_t s, void*) {
    return ncclAllGather(send, recv, n, nccl_type(dtype), c, s);
  });
}

std::shared_ptr<Work> NcclCommunicator::all_reduce(double* inout, int64_t count, ReduceOp op,
                                                   std::string what) {
  Impl& m = *impl_;
  const std::string name = "all_reduce of " + what;
  if (count < 0)
    ZS_THROW(invalid_argument, "rank " << m.rank << ": " << name << ": negative count " << count);
  if (count == 0) return m.empty_work(name);
  const size_t n = size_t(count);
  // Host doubles (the step's norm and overflow flag) are staged through pinned memory.
  Impl::Staging staging;
  if (!cuda::is_device_pointer(inout))
    staging = {inout, n * sizeof(double)};
  else
    m.require_device(inout, name, "inout");
  return m.submit(name, staging, [=](ncclComm_t c, cudaStream_t s, void* staged) {
    void* buf = staged != nullptr ? staged : static_cast<void*>(inout);
    return ncclAllReduce(buf, buf, n, ncclFloat64, nccl_op(op), c, s);
  });
}

std::shared_ptr<Work> NcclCommunicator::broadcast(void* data, int64_t bytes, int root,
                                                  std::string what) {
  Impl& m = *impl_;
  const std::string name = "broadcast of " + what;
  if (bytes < 0 || root < 0 || root >= m.size)
    ZS_THROW(invalid_argument, "rank " << m.rank << ": " << name << ": bad size " << bytes
                                       << " or root " << root << " (world size " << m.size << ")");
  if (bytes == 0) return m.empty_work(name);
  const size_t n = size_t(bytes);
  Impl::Staging staging;
  if (!cuda::is_device_pointer(data))
    staging = {data, n};
  else
    m.require_device(data, name, "data");
  return m.submit(name, staging, [=](ncclComm_t c, cudaStream_t s, void* staged) {
    void* buf = staged != nullptr ? staged : data;
    return ncclBroadcast(buf, buf, n, ncclUint8, root, c, s);
  });
}

void NcclCommunicator::barrier(std::string what) {
  // A one-element all-reduce: completes on a rank only once every rank has joined it.
  double token = 0.0;
  impl_
      ->submit("barrier " + what, {&token, sizeof token},
               [](ncclComm_t c, cudaStream_t s, void* staged) {
                 return ncclAllReduce(staged, staged, 1, ncclFloat64, ncclSum, c, s);
               })
      ->wait();
}

// ---- factories --------------------------------------------------------------------------------

std::shared_ptr<Communicator> make_nccl_communicator(int device,
                                                     std::shared_ptr<Communicator> bootstrap) {
  if (!bootstrap)
    ZS_THROW(invalid_argument, "make_nccl_communicator: bootstrap communicator is null");
  return std::make_shared<NcclCommunicator>(device, *bootstrap);
}

std::shared_ptr<Communicator> make_nccl_communicator(int device) {
#if defined(ZEROSHARD_HAVE_MPI)
  return make_nccl_communicator(device, make_mpi_communicator());
#else
  return make_nccl_communicator(device, make_self_communicator());
#endif
}

}  // namespace zeroshard
