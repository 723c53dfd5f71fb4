// The NCCL communicator: set-up over a bootstrap communicator, teardown, and the argument checks
// of each collective. How collectives are enqueued and watched is in nccl_impl.hpp/.cpp.

#include "src/comm/nccl/nccl_communicator.hpp"

#include <algorithm>
#include <cstdio>
#include <string>

#include "base/check.hpp"
#include "base/cuda_check.hpp"
#include "base/nccl_check.hpp"
#include "base/pieces.hpp"
#include "src/comm/nccl/nccl_impl.hpp"
#include "src/comm/split_check.hpp"

namespace zeroshard {
namespace {

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

// Set-up step 1: every rank checks its device, and all learn whether every rank can go on, so no
// rank waits in NCCL's set-up for a peer that already gave up.
void check_devices(Communicator& bootstrap, int device, const std::string& who) {
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
}

// Set-up step 2: rank 0 creates the unique id; the broadcast carries it or rank 0's failure.
ncclUniqueId exchange_unique_id(Communicator& bootstrap, const std::string& who) {
  struct IdMessage {
    int32_t ok;
    char reason[252];
    ncclUniqueId id;
  } msg{};
  if (bootstrap.rank() == 0) {
    try {
      ZS_NCCL_CHECK(ncclGetUniqueId(&msg.id));
      msg.ok = 1;
    } catch (const Error& e) {
      std::snprintf(msg.reason, sizeof msg.reason, "%s", e.what());
    }
  }
  bootstrap.broadcast(&msg, int64_t(sizeof msg), 0, "NCCL set-up (unique id)")->wait();
  if (msg.ok == 0)
    ZS_THROW(cuda_error, who << ": ncclGetUniqueId failed on rank 0: " << msg.reason);
  return msg.id;
}

}  // namespace

void NcclCommunicator::Impl::require_device(const void* p, const std::string& what,
                                            const char* name) const {
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

// ---- construction and teardown ----------------------------------------------------------------

// The communication stream (highest priority, so collectives are not starved by compute
// kernels) and the staging allocators. The caller holds a DeviceGuard of `device`.
void NcclCommunicator::Impl::open() {
  int least = 0, greatest = 0;
  ZS_CUDA_CHECK(cudaDeviceGetStreamPriorityRange(&least, &greatest));
  stream = cuda::Stream(device, true, greatest);
  input_event = cuda::Event(false);
  order_event = cuda::Event(false);
  dev_stage = cuda::make_caching_allocator(CachingAllocator::Kind::device, device);
  host_stage = cuda::make_caching_allocator(CachingAllocator::Kind::pinned_host, device);
}

NcclCommunicator::NcclCommunicator(int device, int rank, int size, double timeout_s)
    : impl_(std::make_unique<Impl>()) {
  Impl& m = *impl_;
  m.device = device;
  m.rank = rank;
  m.size = size;
  m.timeout_s.store(timeout_s);
  cuda::DeviceGuard guard(device);
  m.open();
}

// ncclCommSplit on this communicator (under its call lock, after a barrier that times out), and
// an agreement on the outcome over it, as at set-up.
std::shared_ptr<Communicator> NcclCommunicator::split(const std::vector<int>& ranks,
                                                      std::string what) {
  Impl& m = *impl_;
  check_split(ranks, m.rank, m.size, what);
  const std::string who = "rank " + std::to_string(m.rank) + ": split of " + what;
  barrier("before the split of " + what);
  const int key = int(std::find(ranks.begin(), ranks.end(), m.rank) - ranks.begin());
  std::shared_ptr<NcclCommunicator> sub(
      new NcclCommunicator(m.device, key, int(ranks.size()), m.timeout_s.load()));
  std::string error;
  ErrorCode code = ErrorCode::cuda_error;
  {
    std::lock_guard<std::mutex> call(m.call_mu);
    cuda::DeviceGuard guard(m.device);
    try {
      if (!m.comm) ZS_THROW(comm_failure, who << ": the communicator is unusable");
      sub->impl_->comm = NcclComm::split(m.comm.get(), ranks.front(), key, kNcclInitTimeoutS, who);
    } catch (const Error& e) {
      error = e.what();
      code = e.code();
    }
  }
  double ok = error.empty() ? 1.0 : 0.0;
  all_reduce(&ok, 1, ReduceOp::min, what + " (split status)")->wait();
  if (!error.empty()) throw Error(code, error);
  if (ok == 0.0) ZS_THROW(cuda_error, who << ": ncclCommSplit failed on another rank");
  Impl& s = *sub->impl_;
  s.watcher = std::thread([&s] { s.watch(); });
  return sub;
}

NcclCommunicator::NcclCommunicator(int device, Communicator& bootstrap)
    : impl_(std::make_unique<Impl>()) {
  Impl& m = *impl_;
  m.device = device;
  m.rank = bootstrap.rank();
  m.size = bootstrap.size();
  const std::string who =
      "rank " + std::to_string(m.rank) + ": make_nccl_communicator(" + std::to_string(device) + ")";
  check_devices(bootstrap, device, who);
  cuda::DeviceGuard guard(device);
  const ncclUniqueId id = exchange_unique_id(bootstrap, who);

  // 3. The streams and staging (open()), and the non-blocking NCCL communicator.
  m.open();
  std::string init_error;
  ErrorCode init_code = ErrorCode::cuda_error;
  try {
    m.comm = NcclComm::init(m.size, id, m.rank, kNcclInitTimeoutS, who);
  } catch (const Error& e) {
    init_error = e.what();
    init_code = e.code();
  }
  // 4. All ranks agree on the outcome, so none keeps a communicator its peers threw away.
  double init_ok = init_error.empty() ? 1.0 : 0.0;
  bootstrap.all_reduce(&init_ok, 1, ReduceOp::min, "NCCL set-up (status)")->wait();
  if (!init_error.empty() || init_ok == 0.0) {
    m.comm.abort();
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
  if (m.comm) {
    (void)cudaSetDevice(m.device);
    // Graceful (flush, wait a bounded time for NCCL to quiesce, then free) unless a collective
    // failed or was given up on; else, and if the graceful end fails, abort.
    if (!m.abandoned && m.poison_reason().empty()) (void)m.comm.finalize(kNcclFinalizeTimeoutS);
    m.comm.abort();
  }
  if (m.abandoned) {
    // Collectives given up on may still use the staging allocators' memory and the stream they
    // were queued on: those go to the quarantine too, freed once the stream has passed them,
    // rather than under a kernel (and cudaFree would wait for it).
    struct Kept {
      std::shared_ptr<cuda::CachingAllocator> dev, host;
      cuda::Stream stream;
    };
    try {
      // Allocated before anything moves into it: a failed allocation leaves them with the
      // communicator, never in a destroyed temporary.
      auto kept = std::make_shared<Kept>();
      kept->dev = std::move(m.dev_stage);
      kept->host = std::move(m.host_stage);
      kept->stream = std::move(m.stream);
      const cudaStream_t s = kept->stream.get();
      m.quarantine.park([s] { return cudaStreamQuery(s) != cudaErrorNotReady; }, std::move(kept));
    } catch (...) {
      // Out of host memory: whatever was not moved yet is freed with the communicator.
    }
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

void NcclCommunicator::set_input_stream(void* stream) {
  std::lock_guard<std::mutex> call(impl_->call_mu);
  impl_->input_stream = stream == nullptr ? cudaStreamLegacy : static_cast<cudaStream_t>(stream);
}

void NcclCommunicator::order_before(void* stream) {
  Impl& m = *impl_;
  std::lock_guard<std::mutex> call(m.call_mu);
  cuda::DeviceGuard guard(m.device);
  m.order_event.record(m.stream.get());
  m.order_event.wait_on(static_cast<cudaStream_t>(stream));
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

std::shared_ptr<Work> NcclCommunicator::all_reduce_sum(void* inout, int64_t count, DType dtype,
                                                       std::string what) {
  Impl& m = *impl_;
  const std::string name = "all_reduce of " + what;
  if (count < 0)
    ZS_THROW(invalid_argument, "rank " << m.rank << ": " << name << ": negative count " << count);
  if (count == 0) return m.empty_work(name);
  m.require_device(inout, name, "inout");
  const size_t n = size_t(count);
  return m.submit(name, {}, [=](ncclComm_t c, cudaStream_t s, void*) {
    return ncclAllReduce(inout, inout, n, nccl_type(dtype), ncclSum, c, s);
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

// ncclSend/ncclRecv for each peer with something to move (this rank's own piece included:
// NCCL copies it).
std::shared_ptr<Work> NcclCommunicator::all_to_all(const void* send, const Pieces& sends,
                                                   void* recv, const Pieces& recvs, DType dtype,
                                                   std::string what) {
  Impl& m = *impl_;
  const std::string name = "all_to_all of " + what;
  check_pieces(sends, m.rank, m.size, what, "send");
  check_pieces(recvs, m.rank, m.size, what, "recv");
  if (pieces_empty(sends) && pieces_empty(recvs)) return m.empty_work(name);
  if (!pieces_empty(sends)) m.require_device(send, name, "send");
  if (!pieces_empty(recvs)) m.require_device(recv, name, "recv");
  const size_t es = dtype_size(dtype);
  // submit() runs the op inside its own ncclGroupStart()/ncclGroupEnd().
  return m.submit(name, {}, [=](ncclComm_t c, cudaStream_t s, void*) {
    ncclResult_t rc = ncclSuccess;
    for (int q = 0; q < int(sends.counts.size()); ++q) {
      const size_t i = size_t(q);
      if (sends.counts[i] > 0)
        rc = ncclSend(static_cast<const char*>(send) + size_t(sends.offsets[i]) * es,
                      size_t(sends.counts[i]), nccl_type(dtype), q, c, s);
      if (rc != ncclSuccess && rc != ncclInProgress) return rc;
      if (recvs.counts[i] > 0)
        rc = ncclRecv(static_cast<char*>(recv) + size_t(recvs.offsets[i]) * es,
                      size_t(recvs.counts[i]), nccl_type(dtype), q, c, s);
      if (rc != ncclSuccess && rc != ncclInProgress) return rc;
    }
    return rc;
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
