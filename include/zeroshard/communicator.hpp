#pragma once
/// \file communicator.hpp
/// Collectives between ranks. Every rank must start the same collectives in the same order;
/// a collective that does not finish within the timeout fails instead of hanging.

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "zeroshard/export.hpp"
#include "zeroshard/types.hpp"

namespace zeroshard {

enum class ReduceOp : uint8_t { sum, max, min };

/// Where all_to_all's pieces lie in one buffer: piece q (to or from rank q) is counts[q]
/// elements starting at element offsets[q]. Both hold one entry per rank.
struct Pieces {
  std::vector<int64_t> counts, offsets;
};

/// Handle of a started collective. wait() blocks until it completes and throws Error
/// (ErrorCode::timeout or comm_failure) naming the collective if it failed. Thread-safe.
class ZS_API Work {
 public:
  virtual ~Work() = default;
  virtual void wait() = 0;
  virtual bool done() = 0;  ///< true once complete or failed; never throws
  /// Blocks until the backend no longer touches the call's buffers (a collective that timed out
  /// may still complete later, when a late peer arrives), or `max_seconds` pass. Returns whether
  /// it settled; never throws. Owners of the buffers call it before freeing them.
  virtual bool wait_settled(double max_seconds) = 0;
  /// When the backend started and finished the collective, in steady-clock seconds; finished is
  /// 0 until it completes. Used to measure how much communication compute hid.
  virtual double started_at() = 0;
  virtual double finished_at() = 0;
};

/// Collectives over a fixed group of ranks. Buffers passed to a call must stay valid and unused
/// by the caller until its Work completes. `what` names the call in error messages, e.g.
/// "reduce_scatter of unit 'layer3'". Implementations start collectives from one communication
/// thread in submission order, so calls may come from any thread as long as every rank submits
/// the same sequence.
class ZS_API Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;

  /// recv (recv_count elements) = this rank's block of the element-wise sum over ranks of send
  /// (size() × recv_count elements). bf16/f16 are added in f32 and rounded to nearest even.
  virtual std::shared_ptr<Work> reduce_scatter(const void* send, void* recv, int64_t recv_count,
                                               DType dtype, std::string what) = 0;
  /// recv (size() × send_count elements) = concatenation of every rank's send, in rank order.
  /// send may alias this rank's block of recv (in-place gather).
  virtual std::shared_ptr<Work> all_gather(const void* send, void* recv, int64_t send_count,
                                           DType dtype, std::string what) = 0;
  /// In-place element-wise reduction of `count` doubles over ranks.
  virtual std::shared_ptr<Work> all_reduce(double* inout, int64_t count, ReduceOp op,
                                           std::string what) = 0;
  /// In-place element-wise sum of `count` elements of `dtype` over ranks, the same result on
  /// every rank (bf16/f16 added as in reduce_scatter). Buffers as reduce_scatter takes them.
  virtual std::shared_ptr<Work> all_reduce_sum(void* inout, int64_t count, DType dtype,
                                               std::string what) = 0;
  /// `bytes` bytes from `root` to every rank, in place.
  virtual std::shared_ptr<Work> broadcast(void* data, int64_t bytes, int root,
                                          std::string what) = 0;
  /// Point-to-point pieces as one collective (MPI's all-to-all-v): this rank sends piece q of
  /// `send` to rank q and receives rank q's piece for it into piece q of `recv` (q = this rank:
  /// a copy). A rank's send count to q must equal q's receive count from it; a count of 0 moves
  /// nothing. Every rank calls it in its place of the sequence, even with nothing to move. No
  /// received piece may overlap another piece of the call. Throws Error(invalid_argument) on
  /// pieces of the wrong number or negative counts or offsets.
  virtual std::shared_ptr<Work> all_to_all(const void* send, const Pieces& sends, void* recv,
                                           const Pieces& recvs, DType dtype, std::string what) = 0;
  virtual void barrier(std::string what) = 0;
  /// A communicator of `ranks` (ranks of this one, ascending, this rank among them), ranked in
  /// that order, with this one's timeout. Collective over this communicator: every rank calls it
  /// in the same place of its sequence of collectives, with the group it joins; the groups
  /// partition the ranks (e.g. {0, 1} and {2, 3}). `what` names it in errors.
  virtual std::shared_ptr<Communicator> split(const std::vector<int>& ranks, std::string what) = 0;

  /// Seconds a collective may take before it fails with ErrorCode::timeout. After a timeout the
  /// communicator is unusable (its peers are out of step): later calls fail with comm_failure.
  virtual void set_timeout(double seconds) = 0;
};

/// A communicator over MPI_COMM_WORLD. Initialises MPI with MPI_THREAD_MULTIPLE if the process
/// has not, and then finalises it when the last such communicator is destroyed.
/// Throws Error(comm_failure) if the MPI library cannot provide MPI_THREAD_MULTIPLE.
///
/// Buffers are host memory; stage_device_buffers() makes it take CUDA device memory too.
ZS_API std::shared_ptr<Communicator> make_mpi_communicator();

/// Ends the whole MPI job now (MPI_Abort on MPI_COMM_WORLD with `code`) when MPI is
/// initialised in this process and its world has more than one rank; returns otherwise. For a rank
/// that fails on its own (bad input, a local error): returning from main() instead runs
/// MPI_Finalize, which waits for every peer, while the peers wait in a collective for this rank
/// until their timeout (Config::collective_timeout_s). The process also aborts the job by itself at
/// exit, instead of finalising, once a collective of its own timed out on peers that no longer
/// answered and never completed: a finalize would wait for them.
ZS_API void abort_mpi_job(int code);

/// Finalises MPI now, when zeroshard initialised it and it is not finalised yet; otherwise does
/// nothing. Every MPI communicator still alive (held by an engine the program never destroyed)
/// first finishes the collectives it has started, as its destructor would, and is closed: its
/// later collectives fail with Error(comm_failure). For the end of a program that leaves engines
/// alive, which would otherwise exit without finalising (and mpirun reports an abnormal end);
/// the Python package calls it at interpreter exit. Aborts the job instead, as the end of the
/// process would, once a collective timed out on peers that no longer answer.
ZS_API void finalize_mpi();

/// A communicator of one rank (no MPI): collectives are copies.
ZS_API std::shared_ptr<Communicator> make_self_communicator();

/// A key-value store every rank of a job reaches, such as the TCPStore torchrun's agent serves
/// (torch.distributed). set() publishes a value under a key, try_get() returns it or nothing
/// yet, without blocking; erase() (optional) drops a key no rank will read again. Values are
/// text (hex). The functions may throw; the collective then fails with comm_failure.
struct KeyValueStore {
  std::function<void(const std::string& key, const std::string& value)> set;
  std::function<std::optional<std::string>(const std::string& key)> try_get;
  std::function<void(const std::string& key)> erase;
};

/// A communicator of `size` ranks (this one `rank`) whose collectives go through `store`, for
/// set-up without an MPI launcher (e.g. bootstrapping NCCL under torchrun): each collective is
/// one round in which every rank publishes its input under "<prefix>/<round>/<rank>" and reads
/// the others', polling, so its cost is the store's round trips and every byte passes through
/// the store's server: a path for set-up and small control values, not for training data. Every
/// rank computes the same result (in rank order). Synchronous: the returned Work is complete.
/// A rank that has not published within the timeout (set_timeout, default 300 s) fails the
/// collective with ErrorCode::timeout naming that rank. Throws Error(invalid_argument) on a
/// rank outside [0, size) or a store without set and try_get.
ZS_API std::shared_ptr<Communicator> make_store_communicator(KeyValueStore store, int rank,
                                                             int size,
                                                             std::string prefix = "zeroshard");

/// `host_comm` (MPI or one-rank) made to accept CUDA device memory as well: reduce_scatter,
/// all_gather (in place too) and broadcast buffers that are device memory (cudaMalloc and the
/// like, of any device; managed memory counts as host memory) are staged through pinned host
/// memory, so that several ranks can share one GPU (which NCCL does not allow): a path for
/// testing, not for speed. An engine on a GPU (Config::device cuda) given a communicator other
/// than NCCL's wraps it so itself. A device input is copied out synchronously in the call, on the
/// legacy default stream: write it from a blocking stream, or synchronise a non-blocking producer
/// first. The result is copied back synchronously by the thread that first sees the collective
/// complete (in wait(), done() or wait_settled()), before that call returns; a failed collective
/// copies nothing back, and neither does a Work dropped before anyone saw it complete. A failed
/// copy throws Error(cuda_error) naming the collective. all_reduce takes host doubles only.
/// Host buffers cost one cudaPointerGetAttributes each. Throws Error(comm_failure) naming the
/// build option when zeroshard was built without CUDA.
ZS_API std::shared_ptr<Communicator> stage_device_buffers(std::shared_ptr<Communicator> host_comm);

/// A communicator over NCCL for buffers in the memory of CUDA device `device` (an index as
/// cudaSetDevice takes it; NCCL allows one rank per GPU, so ranks on one machine pass different
/// devices, usually the local rank). Bootstrapped through MPI_COMM_WORLD (make_mpi_communicator():
/// rank 0 creates NCCL's unique id and broadcasts it); in a build without MPI it is a world of
/// one rank. Collective, like MPI_Init: every rank calls it. Setting up the NCCL communicator may
/// take up to 300 s before it fails with ErrorCode::timeout.
///
/// Buffers: reduce_scatter and all_gather take device memory of `device` (invalid_argument
/// otherwise). all_reduce and broadcast also take host memory (staged through pinned buffers),
/// so small control values such as the step's [sum of squares, overflow flag] pair work as with
/// MPI. bf16/f16 sums are NCCL's (f32 arithmetic, one rounding per addition, in NCCL's order).
///
/// Streams: collectives run in call order on one communication stream of their own. Each one
/// first waits (on the device) for the work already queued on the legacy default stream when it
/// was called, which covers inputs written by cudaMemcpy or by kernels on any blocking stream;
/// producers on non-blocking streams must synchronise or order their work before the call. When
/// Work::done() is true (or wait() returns) the results are visible to the host and to every
/// stream. The timeout runs from the call; on a timeout the NCCL communicator is aborted (as
/// NCCL prescribes, so no kernel spins forever), the Work fails with ErrorCode::timeout naming
/// the collective, and later calls fail with comm_failure.
///
/// Throws Error(cuda_error) if the device or NCCL cannot be set up, and Error(comm_failure)
/// naming the build option when zeroshard was built without CUDA (ZEROSHARD_WITH_CUDA=OFF).
ZS_API std::shared_ptr<Communicator> make_nccl_communicator(int device);

/// As above, bootstrapped through `bootstrap` instead of MPI: its rank and size become the NCCL
/// ranks, and its broadcast carries the unique id (e.g. make_self_communicator() for one rank).
/// The NCCL communicator does not keep `bootstrap`.
ZS_API std::shared_ptr<Communicator> make_nccl_communicator(
    int device, std::shared_ptr<Communicator> bootstrap);

}  // namespace zeroshard
