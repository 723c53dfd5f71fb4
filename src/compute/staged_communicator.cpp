// Device buffers through a host communicator (the contract is in staged_communicator.hpp): every
// call is forwarded; device buffers are swapped for pinned staging blocks around it, with a
// synchronous copy in before the call and a synchronous copy back once the call has completed.

#include "src/compute/staged_communicator.hpp"

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <exception>
#include <mutex>
#include <new>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include "base/check.hpp"
#include "base/pieces.hpp"
#include "base/quarantine.hpp"

namespace zeroshard {
namespace {

using Block = CachingAllocator::Block;
using Clock = std::chrono::steady_clock;

// Errors thrown by the device (its copies, its allocator) do not know which collective they
// served: add it, keeping the code (cuda_error, or no_space for the staging allocator). Errors
// that already name it go on as they are.
[[noreturn]] void rethrow_naming(const Error& e, const std::string& ctx, const char* step) {
  if (std::string_view(e.what()).starts_with(ctx)) throw e;
  throw Error(e.code(), ctx + ": " + step + ": " + e.what());
}

// n × a × b bytes, or false if that overflows size_t (the host communicator then rejects the
// call itself, with its own error).
bool product(int64_t n, size_t a, size_t b, size_t* out) {
  if (n < 0) return false;
  size_t ab = 0, r = 0;
  if (__builtin_mul_overflow(a, b, &ab) || __builtin_mul_overflow(size_t(n), ab, &r)) return false;
  *out = r;
  return true;
}

// A staged device buffer's result, copied back when the collective completes.
struct CopyBack {
  void* device_ptr;
  const void* staging;
  size_t bytes;
  int device;
};

// The Work of a collective with staged buffers. It owns the staging blocks until the host
// collective has settled and performs the copy back exactly once (under mu_), in the first
// thread that observes completion.
class StagedWork final : public Work {
 public:
  StagedWork(std::string ctx, std::shared_ptr<StagingDevice> dev, std::vector<Block> blocks,
             std::vector<CopyBack> back, std::shared_ptr<Quarantine> quarantine)
      : ctx_(std::move(ctx)),
        dev_(std::move(dev)),
        quarantine_(std::move(quarantine)),
        blocks_(std::move(blocks)),
        back_(std::move(back)) {}

  // Set once, right after the host collective was started (before the Work is shared).
  void set_inner(std::shared_ptr<Work> inner) { inner_ = std::move(inner); }

  ~StagedWork() override {
    // A host collective that timed out may still complete when a late peer arrives and write
    // into the staging: the blocks (and the allocator they keep alive) go to the communicator's
    // quarantine then, which returns them to the cache once the host collective has settled,
    // rather than hand them to another call now. Destructors never throw; neither does
    // wait_settled nor park. (If the blocks cannot be moved, they go back to the cache:
    // nothing better is left.)
    if (inner_ && !blocks_.empty() && !inner_->wait_settled(0)) {
      try {
        auto blocks = std::make_shared<std::vector<Block>>(std::move(blocks_));
        quarantine_->park([inner = inner_] { return inner->wait_settled(0); }, std::move(blocks));
      } catch (...) {
      }
    }
  }

  void wait() override {
    inner_->wait();  // the host collective's errors propagate unchanged
    std::lock_guard<std::mutex> lock(mu_);
    finish_locked();
    if (copy_error_) std::rethrow_exception(copy_error_);
  }

  bool done() override {
    if (!inner_->done()) return false;
    std::lock_guard<std::mutex> lock(mu_);
    finish_locked();
    return true;
  }

  bool wait_settled(double max_seconds) override {
    // Clamped so that "forever" (1e300) does not overflow the clock's representation.
    const double s = max_seconds > 0 ? std::min(max_seconds, 1e7) : 0.0;
    const auto deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                             std::chrono::duration<double>(s));
    if (!inner_->wait_settled(s)) return false;
    // Settled but not complete is a backend oddity; the copy back might still be due, so the
    // device buffer is not safe to free yet.
    if (!inner_->done()) return false;
    // Another thread may be copying back: poll, as the wait is short and rare (a timed
    // mutex's clocked lock is one ThreadSanitizer does not see taken).
    std::unique_lock<std::mutex> lock(mu_, std::defer_lock);
    while (!lock.try_lock()) {
      if (Clock::now() >= deadline) return false;
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
    finish_locked();
    return true;
  }

  double started_at() override { return inner_->started_at(); }
  double finished_at() override { return inner_->finished_at(); }

 private:
  // The host collective has completed or failed: copy the results back (if it completed) and
  // return the staging once the host communicator is done with it. Never throws: a failed
  // copy back is kept for wait(). Caller holds mu_.
  void finish_locked() noexcept {
    if (finished_) return;
    finished_ = true;
    bool ok = true;
    try {
      inner_->wait();  // done() was true: returns or throws at once
    } catch (...) {
      ok = false;  // failed: nothing is copied back; the device buffers keep their contents
    }
    if (ok) {
      try {
        copy_back();
      } catch (...) {
        copy_error_ = std::current_exception();
      }
    }
    if (inner_->wait_settled(0)) blocks_.clear();
  }

  void copy_back() {
    for (const CopyBack& c : back_) {
      try {
        dev_->to_device(c.device_ptr, c.staging, c.bytes, c.device);
      } catch (const Error& e) {
        rethrow_naming(e, ctx_, "copying the result back to device memory");
      }
    }
  }

  const std::string ctx_;  // "rank 1: reduce_scatter of unit 'layer3'"
  std::shared_ptr<StagingDevice> dev_;
  std::shared_ptr<Quarantine> quarantine_;  // the communicator's: outlives it if need be
  std::shared_ptr<Work> inner_;
  std::mutex mu_;  // guards everything below
  bool finished_ = false;
  std::exception_ptr copy_error_;
  std::vector<Block> blocks_;
  std::vector<CopyBack> back_;
};

class StagedCommunicator final : public Communicator {
 public:
  StagedCommunicator(std::shared_ptr<Communicator> inner, std::shared_ptr<StagingDevice> dev)
      : inner_(std::move(inner)), dev_(std::move(dev)) {}

  int rank() const override { return inner_->rank(); }
  int size() const override { return inner_->size(); }

  std::shared_ptr<Work> reduce_scatter(const void* send, void* recv, int64_t recv_count,
                                       DType dtype, std::string what) override {
    size_t recv_bytes = 0, send_bytes = 0;
    if (recv_count == 0 || !product(recv_count, dtype_size(dtype), 1, &recv_bytes) ||
        !product(recv_count, dtype_size(dtype), size_t(size()), &send_bytes))
      return inner_->reduce_scatter(send, recv, recv_count, dtype, std::move(what));
    Staging st(*this, label("reduce_scatter of ", what));
    const void* hsend = st.stage(send, send_bytes, 0, send_bytes, false);
    void* hrecv = st.stage(recv, recv_bytes, 0, 0, true);
    if (st.empty()) return inner_->reduce_scatter(send, recv, recv_count, dtype, std::move(what));
    return st.run(
        [&] { return inner_->reduce_scatter(hsend, hrecv, recv_count, dtype, std::move(what)); });
  }

  std::shared_ptr<Work> all_gather(const void* send, void* recv, int64_t send_count, DType dtype,
                                   std::string what) override {
    size_t send_bytes = 0, recv_bytes = 0, own = 0;
    if (send_count == 0 || !product(send_count, dtype_size(dtype), 1, &send_bytes) ||
        !product(send_count, dtype_size(dtype), size_t(size()), &recv_bytes) ||
        !product(send_count, dtype_size(dtype), size_t(rank()), &own))
      return inner_->all_gather(send, recv, send_count, dtype, std::move(what));
    Staging st(*this, label("all_gather of ", what));
    const void* hsend = nullptr;
    void* hrecv = nullptr;
    if (send == static_cast<const char*>(recv) + own) {
      // In place: only this rank's block goes in; the host collective then sees its own
      // in-place form (send is its block of recv) on the staging.
      hrecv = st.stage(recv, recv_bytes, own, send_bytes, true);
      hsend = static_cast<const char*>(hrecv) + own;
    } else {
      hsend = st.stage(send, send_bytes, 0, send_bytes, false);
      hrecv = st.stage(recv, recv_bytes, 0, 0, true);
    }
    if (st.empty()) return inner_->all_gather(send, recv, send_count, dtype, std::move(what));
    return st.run(
        [&] { return inner_->all_gather(hsend, hrecv, send_count, dtype, std::move(what)); });
  }

  std::shared_ptr<Work> all_reduce(double* inout, int64_t count, ReduceOp op,
                                   std::string what) override {
    return inner_->all_reduce(inout, count, op, std::move(what));
  }

  std::shared_ptr<Work> broadcast(void* data, int64_t bytes, int root, std::string what) override {
    if (bytes <= 0) return inner_->broadcast(data, bytes, root, std::move(what));
    const size_t n = size_t(bytes);
    Staging st(*this, label("broadcast of ", what));
    // The root's data goes in and is unchanged by a broadcast; the others' comes back.
    const bool is_root = root == rank();
    void* h = st.stage(data, n, 0, is_root ? n : 0, !is_root);
    if (st.empty()) return inner_->broadcast(data, bytes, root, std::move(what));
    return st.run([&] { return inner_->broadcast(h, bytes, root, std::move(what)); });
  }

  std::shared_ptr<Work> all_reduce_sum(void* inout, int64_t count, DType dtype,
                                       std::string what) override {
    size_t bytes = 0;
    if (count == 0 || !product(count, dtype_size(dtype), 1, &bytes))
      return inner_->all_reduce_sum(inout, count, dtype, std::move(what));
    Staging st(*this, label("all_reduce of ", what));
    void* h = st.stage(inout, bytes, 0, bytes, true);
    if (st.empty()) return inner_->all_reduce_sum(inout, count, dtype, std::move(what));
    return st.run([&] { return inner_->all_reduce_sum(h, count, dtype, std::move(what)); });
  }

  // The span from each buffer's start to its last piece is staged; only the pieces are copied
  // in (send) and back (recv), so what lies between the received pieces stays as it was.
  std::shared_ptr<Work> all_to_all(const void* send, const Pieces& sends, void* recv,
                                   const Pieces& recvs, DType dtype, std::string what) override {
    check_pieces(sends, rank(), size(), what, "send");
    check_pieces(recvs, rank(), size(), what, "recv");
    const size_t es = dtype_size(dtype);
    Staging st(*this, label("all_to_all of ", what));
    const void* hsend = st.stage_pieces(send, sends, es, false);
    void* hrecv = st.stage_pieces(recv, recvs, es, true);
    if (st.empty()) return inner_->all_to_all(send, sends, recv, recvs, dtype, std::move(what));
    return st.run(
        [&] { return inner_->all_to_all(hsend, sends, hrecv, recvs, dtype, std::move(what)); });
  }

  void barrier(std::string what) override { inner_->barrier(std::move(what)); }
  std::shared_ptr<Communicator> split(const std::vector<int>& ranks, std::string what) override {
    return std::make_shared<StagedCommunicator>(inner_->split(ranks, std::move(what)), dev_);
  }
  void set_timeout(double seconds) override { inner_->set_timeout(seconds); }

 private:
  // The staging of one call: classifies its buffers, fills the staging blocks and, once the
  // host collective has started, hands them to the call's Work.
  class Staging {
   public:
    Staging(StagedCommunicator& comm, std::string ctx) : comm_(comm), ctx_(std::move(ctx)) {}

    // Returns `p` itself unless it is device memory; then a pinned block of `bytes`, into which
    // bytes [in_offset, in_offset + in_bytes) of p are copied now, and from which all of p is
    // copied back at completion if `copy_back`. `device_out`, where given, gets p's device (or
    // -1).
    void* stage(const void* p, size_t bytes, size_t in_offset, size_t in_bytes, bool copy_back,
                int* device_out = nullptr) {
      int device = -1;
      try {
        device = comm_.dev_->device_of(p);
      } catch (const Error& e) {
        rethrow_naming(e, ctx_, "classifying a buffer");
      }
      if (device_out) *device_out = device;
      if (device < 0) return const_cast<void*>(p);
      const char* step = "staging a device buffer";
      try {
        Block block = comm_.staging_allocator(device)->allocate(bytes);
        step = "copying the input to pinned staging";
        if (in_bytes > 0)
          comm_.dev_->to_host(block.as<char>() + in_offset, static_cast<const char*>(p) + in_offset,
                              in_bytes, device);
        void* host = block.data();
        blocks_.push_back(std::move(block));
        if (copy_back) back_.push_back({const_cast<void*>(p), host, bytes, device});
        return host;
      } catch (const Error& e) {
        rethrow_naming(e, ctx_, step);
      }
    }

    // As stage(), for the buffer of an all_to_all's `pieces` (elements of `es` bytes): pieces
    // are copied in now, or (`out`) back at completion, one by one.
    void* stage_pieces(const void* p, const Pieces& pieces, size_t es, bool out) {
      const size_t bytes = size_t(pieces_extent(pieces)) * es;
      if (bytes == 0) return const_cast<void*>(p);
      int device = -1;
      char* host = static_cast<char*>(stage(p, bytes, 0, 0, false, &device));
      if (device < 0) return host;
      for (size_t q = 0; q < pieces.counts.size(); ++q) {
        const size_t at = size_t(pieces.offsets[q]) * es, n = size_t(pieces.counts[q]) * es;
        if (n == 0) continue;
        char* dev = static_cast<char*>(const_cast<void*>(p)) + at;
        if (out) {
          back_.push_back({dev, host + at, n, device});
          continue;
        }
        try {
          comm_.dev_->to_host(host + at, dev, n, device);
        } catch (const Error& e) {
          rethrow_naming(e, ctx_, "copying the input to pinned staging");
        }
      }
      return host;
    }

    bool empty() const { return blocks_.empty(); }

    // Starts the host collective on the staging; its Work is wrapped in one that copies back.
    // The wrapper exists before the collective starts, so no failure after the start can
    // return the blocks to the cache while the host communicator still uses them.
    template <class Start>
    std::shared_ptr<Work> run(Start&& start) {
      comm_.quarantine_->reap();  // blocks of earlier timed-out calls whose peers came late
      auto work = std::make_shared<StagedWork>(ctx_, comm_.dev_, std::move(blocks_),
                                               std::move(back_), comm_.quarantine_);
      work->set_inner(start());
      return work;
    }

   private:
    StagedCommunicator& comm_;
    const std::string ctx_;
    std::vector<Block> blocks_;
    std::vector<CopyBack> back_;
  };

  std::string label(const char* kind, const std::string& what) const {
    return "rank " + std::to_string(rank()) + ": " + kind + what;
  }

  // One pinned allocator for the communicator, made on first use (so a communicator that only
  // ever sees host buffers allocates nothing). Its blocks are pinned memory every device can
  // copy with.
  std::shared_ptr<CachingAllocator> staging_allocator(int device) {
    std::lock_guard<std::mutex> lock(mu_);
    if (!pinned_) pinned_ = dev_->pinned_allocator(device);
    return pinned_;
  }

  std::shared_ptr<Communicator> inner_;
  std::shared_ptr<StagingDevice> dev_;
  std::mutex mu_;
  std::shared_ptr<CachingAllocator> pinned_;  // guarded by mu_
  // Staging of collectives dropped before they settled (see ~StagedWork). Shared with the
  // Works, so that the last of them and the communicator reap it.
  std::shared_ptr<Quarantine> quarantine_ = std::make_shared<Quarantine>();
};

}  // namespace

std::shared_ptr<Communicator> stage_through(std::shared_ptr<Communicator> host_comm,
                                            std::shared_ptr<StagingDevice> dev) {
  ZS_CHECK(host_comm != nullptr && dev != nullptr);
  return std::make_shared<StagedCommunicator>(std::move(host_comm), std::move(dev));
}

}  // namespace zeroshard
