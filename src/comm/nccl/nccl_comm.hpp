#pragma once
// NcclComm: the move-only owner of a raw ncclComm_t (docs/DESIGN.md rule 3). Destroying it aborts
// the communicator (ncclCommAbort never waits for peers, so a destructor cannot hang on a dead
// one); the graceful end, which flushes outstanding work first, is finalize(). Not thread-safe:
// NCCL communicators are not, and their owner serialises every call on them.

#include <nccl.h>

#include <string>

namespace zeroshard {

class NcclComm {
 public:
  NcclComm() = default;
  /// Creates the rank's non-blocking communicator (ncclCommInitRankConfig, config.blocking = 0)
  /// and polls it until it is ready. Throws Error(timeout) after `timeout_s` seconds (a peer
  /// is late or dead) and Error(cuda_error) if NCCL fails; `who` starts the message. Collective
  /// over the `size` ranks that share `id`; the calling thread's device is the communicator's.
  static NcclComm init(int size, const ncclUniqueId& id, int rank, double timeout_s,
                       const std::string& who);
  /// The rank's part of `parent` split by `color` (ncclCommSplit, non-blocking, polled as
  /// init() is), ranked by `key`. Collective over `parent`, whose owner holds its call lock.
  static NcclComm split(ncclComm_t parent, int color, int key, double timeout_s,
                        const std::string& who);
  ~NcclComm() { abort(); }
  NcclComm(NcclComm&& o) noexcept;
  NcclComm& operator=(NcclComm&& o) noexcept;
  NcclComm(const NcclComm&) = delete;
  NcclComm& operator=(const NcclComm&) = delete;

  ncclComm_t get() const noexcept { return comm_; }
  explicit operator bool() const noexcept { return comm_ != nullptr; }

  /// The state of the communicator's asynchronous work: ncclSuccess, ncclInProgress while a
  /// non-blocking call is still being carried out, or the error that broke it.
  ncclResult_t async_state() const noexcept;
  /// ncclCommAbort: kernels waiting on peers return and the communicator is freed. Never throws.
  void abort() noexcept;
  /// The graceful end: ncclCommFinalize (flushes outstanding work), polled for `timeout_s`
  /// seconds, then ncclCommDestroy. Aborts instead if that fails or times out. Returns whether
  /// the end was graceful. Never throws.
  bool finalize(double timeout_s) noexcept;

 private:
  explicit NcclComm(ncclComm_t comm) noexcept : comm_(comm) {}
  // Takes `raw` over and polls it until `rc`, the result of `call`, settles.
  static NcclComm ready(ncclComm_t raw, ncclResult_t rc, double timeout_s, const std::string& who,
                        const char* call);
  ncclComm_t comm_ = nullptr;
};

}  // namespace zeroshard
