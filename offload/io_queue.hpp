#pragma once
// The swapper's I/O thread. Callers hand it batches of pieces (one unit's extent, split at
// stripe boundaries) and wait on the batch; the thread keeps up to queue_depth requests in
// flight through the IoBackend, so the drive stays busy while the caller computes.
//
// Every completion is checked: EINTR and EAGAIN are resubmitted, a short transfer is resubmitted
// for the remainder (through the buffered descriptor if the remainder breaks O_DIRECT
// alignment), a read that hits end-of-file fails as truncation, any other error fails the batch
// with a message naming the file, offset, size and errno. Writes are checksummed (XXH64, seeded
// with the block's logical offset) right after they are submitted, while the drive works (their
// buffers must not change until the batch is done anyway); reads are verified once they complete
// and the queue has been refilled. A failed batch submits nothing more but lets its in-flight
// requests finish, so its buffers are free once it is done.

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "offload/io_backend.hpp"
#include "zeroshard/error.hpp"

namespace zeroshard::offload {

/// One request's worth of a transfer: at most one stripe (block_size bytes) of one file.
struct Piece {
  int file = 0;            ///< O_DIRECT descriptor's index in the queue's file table
  int fallback_file = -1;  ///< buffered descriptor of the same file (for misaligned remainders)
  uint64_t offset = 0;     ///< in the file
  uint32_t len = 0;
  bool write = false;
  char* buf = nullptr;
  int buf_index = -1;            ///< registered buffer, or -1
  uint64_t* checksum = nullptr;  ///< write: stored here; read: compared with this; null: none
  uint64_t seed = 0;             ///< checksum seed (the block's logical offset in its store)
};

/// Counters of everything the queue moved since it was created.
struct IoCounters {
  int64_t bytes_read = 0, bytes_written = 0;
  int64_t requests = 0, resubmitted = 0;
};

class IoQueue;

/// A group of pieces that completes as one: done once every piece finished or, after a failure,
/// once no piece is in flight any more.
class IoBatch {
 public:
  bool done() const;
  /// The first failure (set once done()); empty if every piece succeeded.
  std::optional<Error> error() const;
  const std::string& what() const { return what_; }

 private:
  friend class IoQueue;
  std::string what_;
  std::vector<Piece> pieces_;
  size_t next_ = 0;  // first piece not yet submitted
  int in_flight_ = 0;
  bool failed_ = false;
  bool done_ = false;
  bool background_ = false;
  std::optional<Error> error_;
  IoQueue* queue_ = nullptr;
};

class IoQueue {
 public:
  /// `file_names[i]` names file i in error messages. Starts the I/O thread.
  IoQueue(std::unique_ptr<IoBackend> backend, std::vector<std::string> file_names);
  /// Waits for every request in flight, then stops the thread. Never throws.
  ~IoQueue();
  IoQueue(const IoQueue&) = delete;
  IoQueue& operator=(const IoQueue&) = delete;

  /// Queues `pieces` (buffers must stay valid until the batch is done). `what` starts every
  /// error message of the batch, e.g. "rank 1: nvme swap read of unit 'layer3' (optimizer state)".
  /// A `background` batch (work ahead of time, as the speculative step's) starts only where no
  /// other batch is waiting: batches submitted later go ahead of its pieces not yet started.
  std::shared_ptr<IoBatch> submit(std::vector<Piece> pieces, std::string what,
                                  bool background = false);
  /// Blocks until `b` is done; never throws.
  void settle(IoBatch& b);
  /// settle(), then throws the batch's error if it failed.
  void wait(IoBatch& b);
  /// Seconds callers spent blocked in settle()/wait().
  double wait_seconds() const;
  IoCounters counters() const;

  /// A transient error (EAGAIN, EINTR) is retried this many times per request before failing.
  static constexpr int kMaxRetries = 1000;

 private:
  friend class IoBatch;  // batches read their state under the queue's lock
  struct Slot {          // one request in flight
    IoBatch* batch = nullptr;
    std::shared_ptr<IoBatch> keep;  // the batch outlives its requests
    size_t piece = 0;
    uint32_t done = 0;  // bytes of the piece already transferred
    int retries = 0;
  };
  struct Verify {  // a read that completed, its checksum still to check
    std::shared_ptr<IoBatch> batch;
    size_t piece;
  };
  void run();
  bool take(std::vector<int>& fresh, bool& more_waiting);
  void fail_everything(const std::exception& e);
  IoOp op_for(const Slot& s, int tag) const;
  void complete(int tag, int res);
  void verify(Verify& v);
  void fail(IoBatch& b, ErrorCode code, const std::string& msg);
  void finish_if_done(IoBatch& b);
  std::string describe(const Slot& s, uint32_t len) const;

  std::unique_ptr<IoBackend> backend_;
  std::vector<std::string> names_;
  mutable std::mutex mu_;
  std::condition_variable work_cv_, done_cv_;
  std::deque<std::shared_ptr<IoBatch>> queue_;  // batches with pieces left to submit
  // I/O thread only: requests in flight, by tag; tags to send again; reads to verify.
  std::vector<Slot> slots_;
  std::vector<int> resubmit_;
  std::vector<Verify> verify_;
  std::vector<int> free_tags_;  // under mu_ (taken while moving pieces out of queue_)
  int in_flight_ = 0;           // requests the backend holds (under mu_)
  bool stop_ = false;
  IoCounters counters_;
  double wait_s_ = 0;
  std::thread thread_;
};

}  // namespace zeroshard::offload
