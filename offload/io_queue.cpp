#include "offload/io_queue.hpp"

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <sstream>

#include "base/check.hpp"
#include "base/checksum.hpp"

namespace zeroshard::offload {
namespace {

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// "ENOSPC" style names make the message greppable whatever the locale.
const char* errno_name(int e) {
  switch (e) {
    case EIO:
      return "EIO";
    case ENOSPC:
      return "ENOSPC";
    case EDQUOT:
      return "EDQUOT";
    case EINVAL:
      return "EINVAL";
    case EROFS:
      return "EROFS";
    case EBADF:
      return "EBADF";
    case EFAULT:
      return "EFAULT";
    case EFBIG:
      return "EFBIG";
    case ENOMEM:
      return "ENOMEM";
    case EAGAIN:
      return "EAGAIN";
    case EINTR:
      return "EINTR";
    case ENODEV:
      return "ENODEV";
    case ENXIO:
      return "ENXIO";
    default:
      return "errno";
  }
}

}  // namespace

bool IoBatch::done() const {
  std::lock_guard<std::mutex> lock(queue_->mu_);
  return done_;
}

std::optional<Error> IoBatch::error() const {
  std::lock_guard<std::mutex> lock(queue_->mu_);
  return error_;
}

IoQueue::IoQueue(std::unique_ptr<IoBackend> backend, std::vector<std::string> file_names)
    : backend_(std::move(backend)), names_(std::move(file_names)) {
  const int depth = std::max(1, backend_->depth());
  slots_.resize(size_t(depth));
  for (int t = depth - 1; t >= 0; --t) free_tags_.push_back(t);
  thread_ = std::thread([this] { run(); });
}

IoQueue::~IoQueue() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  work_cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

std::shared_ptr<IoBatch> IoQueue::submit(std::vector<Piece> pieces, std::string what,
                                         bool background) {
  auto b = std::make_shared<IoBatch>();
  b->what_ = std::move(what);
  b->pieces_ = std::move(pieces);
  b->queue_ = this;
  b->background_ = background;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stop_) {
      b->failed_ = b->done_ = true;
      b->error_ = Error(ErrorCode::internal, b->what_ + ": the I/O queue has stopped");
      return b;
    }
    if (b->pieces_.empty()) {
      b->done_ = true;
      return b;
    }
    // In order, but ahead of the background batches' pieces not yet started.
    auto at = background ? queue_.end()
                         : std::find_if(queue_.begin(), queue_.end(),
                                        [](const auto& q) { return q->background_; });
    queue_.insert(at, b);
  }
  work_cv_.notify_one();
  return b;
}

void IoQueue::settle(IoBatch& b) {
  std::unique_lock<std::mutex> lock(mu_);
  if (b.done_) return;
  const double t0 = now_s();
  done_cv_.wait(lock, [&] { return b.done_; });
  wait_s_ += now_s() - t0;
}

void IoQueue::wait(IoBatch& b) {
  settle(b);
  std::lock_guard<std::mutex> lock(mu_);
  if (b.error_) throw *b.error_;
}

double IoQueue::wait_seconds() const {
  std::lock_guard<std::mutex> lock(mu_);
  return wait_s_;
}

IoCounters IoQueue::counters() const {
  std::lock_guard<std::mutex> lock(mu_);
  return counters_;
}

// Under mu_.
void IoQueue::fail(IoBatch& b, ErrorCode code, const std::string& msg) {
  if (!b.failed_) {
    b.failed_ = true;
    b.error_ = Error(code, b.what_ + ": " + msg);
  }
}

// Under mu_.
void IoQueue::finish_if_done(IoBatch& b) {
  if (b.done_ || b.in_flight_ > 0) return;
  if (!b.failed_ && b.next_ < b.pieces_.size()) return;
  b.done_ = true;
  done_cv_.notify_all();
}

std::string IoQueue::describe(const Slot& s, uint32_t len) const {
  const Piece& p = s.batch->pieces_[s.piece];
  std::ostringstream os;
  os << (p.write ? "write" : "read") << " of " << len << " bytes at offset " << (p.offset + s.done)
     << " of " << names_[size_t(p.file)];
  return os.str();
}

// The IoOp for the rest of slot s's piece. The remainder of a short transfer may break
// O_DIRECT's alignment; it then goes through the file's buffered descriptor (coherent with
// direct I/O on Linux), instead of failing with EINVAL.
IoOp IoQueue::op_for(const Slot& s, int tag) const {
  const Piece& p = s.batch->pieces_[s.piece];
  IoOp op;
  op.tag = uint64_t(tag);
  op.write = p.write;
  op.buf = p.buf + s.done;
  op.len = p.len - s.done;
  op.offset = p.offset + s.done;
  op.buf_index = p.buf_index;
  const bool aligned = ((reinterpret_cast<uintptr_t>(op.buf) | op.offset | op.len) & 4095) == 0;
  op.file = aligned || p.fallback_file < 0 ? p.file : p.fallback_file;
  return op;
}

// One loop: take new pieces while requests are free, submit them (and any remainders) in one
// call, then do the CPU work while the drive works: checksum the writes just submitted (their
// buffers do not change while in flight) and verify the reads completed last time. Only then
// wait for completions, blocking only when there is nothing else to do.
void IoQueue::run() {
  const int depth = int(slots_.size());
  std::vector<IoCompletion> cqes(static_cast<size_t>(depth));
  std::vector<int> fresh;  // tags taken for new pieces
  std::vector<IoOp> ops;
  try {
    for (;;) {
      fresh.clear();
      bool more_waiting = false;
      if (!take(fresh, more_waiting)) break;
      ops.clear();
      for (int tag : resubmit_) ops.push_back(op_for(slots_[size_t(tag)], tag));
      for (int tag : fresh) ops.push_back(op_for(slots_[size_t(tag)], tag));
      resubmit_.clear();
      bool hashing = !verify_.empty();
      for (int tag : fresh) {
        const Piece& p = slots_[size_t(tag)].batch->pieces_[slots_[size_t(tag)].piece];
        hashing = hashing || (p.write && p.checksum);
      }
      int ready = 0;
      if (!ops.empty()) {
        backend_->submit(ops.data(), int(ops.size()));
        // CPU work ahead: start the requests now (a non-blocking reap submits them), and keep
        // what already completed for after the checksums are in place.
        if (hashing) ready = backend_->reap(cqes.data(), depth, 0);
      }
      for (int tag : fresh) {
        const Piece& p = slots_[size_t(tag)].batch->pieces_[slots_[size_t(tag)].piece];
        if (p.write && p.checksum) *p.checksum = xxh64(p.buf, p.len, p.seed);
      }
      for (Verify& v : verify_) verify(v);
      verify_.clear();
      for (int i = 0; i < ready; ++i) complete(int(cqes[size_t(i)].tag), cqes[size_t(i)].res);
      if (ready > 0) continue;  // completions freed requests: refill before blocking
      int busy;
      {
        std::lock_guard<std::mutex> lock(mu_);
        busy = in_flight_;
      }
      if (busy == 0) continue;
      // Block only if no request is free for queued work (or none is queued).
      int n = backend_->reap(cqes.data(), depth, more_waiting ? 0 : 1);
      for (int i = 0; i < n; ++i) complete(int(cqes[size_t(i)].tag), cqes[size_t(i)].res);
    }
  } catch (const std::exception& e) {
    fail_everything(e);
  }
}

// Under the lock: waits for work, drops what a stop left queued, and keeps the ring full by
// taking pieces in batch order while requests are free (their tags into `fresh`). Returns false
// when the loop is to end (stopped, nothing in flight).
bool IoQueue::take(std::vector<int>& fresh, bool& more_waiting) {
  std::unique_lock<std::mutex> lock(mu_);
  work_cv_.wait(lock,
                [&] { return stop_ || in_flight_ > 0 || !queue_.empty() || !verify_.empty(); });
  if (stop_) {
    // The owner settled what it needed; anything still queued is dropped, not submitted.
    for (auto& b : queue_) {
      fail(*b, ErrorCode::internal, "the I/O queue stopped before this transfer was submitted");
      finish_if_done(*b);
    }
    queue_.clear();
    if (in_flight_ == 0 && verify_.empty() && resubmit_.empty()) return false;
  }
  while (!free_tags_.empty() && !queue_.empty()) {
    std::shared_ptr<IoBatch> b = queue_.front();
    if (b->failed_ || b->next_ >= b->pieces_.size()) {
      queue_.pop_front();
      finish_if_done(*b);
      continue;
    }
    int tag = free_tags_.back();
    free_tags_.pop_back();
    slots_[size_t(tag)] = Slot{b.get(), b, b->next_++, 0, 0};
    ++b->in_flight_;
    ++in_flight_;
    ++counters_.requests;
    fresh.push_back(tag);
    if (b->next_ >= b->pieces_.size()) queue_.pop_front();  // all of it is in flight now
  }
  more_waiting = !queue_.empty() && !free_tags_.empty();
  return true;
}

// The ring itself failed: nothing in flight can be completed any more. Fail every batch so no
// caller waits forever.
void IoQueue::fail_everything(const std::exception& e) {
  std::lock_guard<std::mutex> lock(mu_);
  std::string msg = std::string("the io_uring failed: ") + e.what();
  auto fail_all = [&](IoBatch& b) {
    fail(b, ErrorCode::io_error, msg);
    b.in_flight_ = 0;
    finish_if_done(b);
  };
  for (Slot& s : slots_)
    if (s.batch) fail_all(*s.batch);
  for (Verify& v : verify_) fail_all(*v.batch);
  for (auto& b : queue_) fail_all(*b);
  queue_.clear();
  stop_ = true;
}

void IoQueue::complete(int tag, int res) {
  ZS_CHECK(tag >= 0 && tag < int(slots_.size()) && slots_[size_t(tag)].batch);
  Slot& s = slots_[size_t(tag)];
  IoBatch& b = *s.batch;
  const Piece& p = b.pieces_[s.piece];
  const uint32_t want = p.len - s.done;
  bool again = false, check = false;
  std::lock_guard<std::mutex> lock(mu_);
  if (b.failed_) {
    // The batch already failed: let the request go, submit nothing more for it.
  } else if (res == -EINTR || res == -EAGAIN) {
    if (++s.retries <= kMaxRetries) {
      again = true;
    } else {
      fail(b, ErrorCode::io_error,
           describe(s, want) + " failed " + std::to_string(kMaxRetries) + " times with " +
               errno_name(-res) + ": " + std::strerror(-res));
    }
  } else if (res < 0) {
    const int e = -res;
    const ErrorCode code = e == ENOSPC || e == EDQUOT ? ErrorCode::no_space : ErrorCode::io_error;
    fail(b, code, describe(s, want) + " failed: " + std::strerror(e) + " (" + errno_name(e) + ")");
  } else if (res == 0 && want > 0) {
    if (!p.write) {
      fail(b, ErrorCode::corrupted,
           describe(s, want) +
               " reached the end of the file: the swap file was "
               "truncated behind the engine's back");
    } else if (++s.retries <= kMaxRetries) {
      again = true;  // a write that made no progress: try again, as for EAGAIN
    } else {
      fail(b, ErrorCode::io_error, describe(s, want) + " made no progress");
    }
  } else if (uint32_t(res) > want) {
    fail(b, ErrorCode::internal, describe(s, want) + " returned " + std::to_string(res) + " bytes");
  } else {
    s.done += uint32_t(res);
    (p.write ? counters_.bytes_written : counters_.bytes_read) += res;
    if (s.done < p.len)
      again = true;  // short transfer: the remainder goes again
    else
      check = !p.write && p.checksum;
  }
  if (again) {
    ++counters_.resubmitted;
    resubmit_.push_back(tag);
    return;
  }
  // The request is over; the tag is free again. A read still owes its checksum check: the batch
  // keeps counting it until verify() has run.
  std::shared_ptr<IoBatch> keep = std::move(s.keep);
  const size_t piece = s.piece;
  s.batch = nullptr;
  free_tags_.push_back(tag);
  --in_flight_;
  if (check) {
    verify_.push_back({std::move(keep), piece});
    return;
  }
  --b.in_flight_;
  finish_if_done(b);
}

void IoQueue::verify(Verify& v) {
  const Piece& p = v.batch->pieces_[v.piece];
  const bool bad = xxh64(p.buf, p.len, p.seed) != *p.checksum;
  std::lock_guard<std::mutex> lock(mu_);
  if (bad && !v.batch->failed_) {
    std::ostringstream os;
    os << "read of " << p.len << " bytes at offset " << p.offset << " of " << names_[size_t(p.file)]
       << ": checksum mismatch: the data read back is not what was written (the swap file was "
          "corrupted)";
    fail(*v.batch, ErrorCode::corrupted, os.str());
  }
  --v.batch->in_flight_;
  finish_if_done(*v.batch);
}

}  // namespace zeroshard::offload
