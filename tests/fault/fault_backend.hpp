#pragma once
// Fault injection at the swapper's I/O seam: a backend that wraps the real io_uring one and,
// as its plan says, fails a chosen request with an errno, shortens requests (really, so the
// kernel moves fewer bytes; or by reporting fewer bytes than moved, to break O_DIRECT alignment
// of the remainder), answers EAGAIN/EINTR first, or flips a bit of the data a read brought in.
// Everything else goes to the real backend unchanged.

#include <atomic>
#include <cerrno>
#include <deque>
#include <map>
#include <memory>
#include <mutex>

#include "offload/io_backend.hpp"

namespace zs_fault {

struct FaultPlan {
  std::atomic<bool> armed{false};  ///< faults apply only while armed
  int fail_write_at = -1;          ///< the n-th write request (0-based, counted while armed) fails
  int fail_read_at = -1;           ///< the n-th read request fails
  int error = EIO;                 ///< with this errno
  bool short_aligned =
      false;  ///< requests above 4 KiB move only their first half (rounded to 4 KiB)
  bool short_misaligned = false;  ///< completions report 100 bytes fewer than moved
  int transient_every = 0;        ///< every n-th request is answered EAGAIN (odd n) / EINTR first
  int flip_read_at = -1;          ///< the n-th read's data gets a bit flipped on completion
  std::atomic<int> reads{0}, writes{0}, injected{0};
};

class FaultBackend final : public zeroshard::offload::IoBackend {
 public:
  FaultBackend(std::unique_ptr<IoBackend> inner, std::shared_ptr<FaultPlan> plan)
      : inner_(std::move(inner)), plan_(std::move(plan)) {}

  int depth() const override { return inner_->depth(); }

  void submit(const zeroshard::offload::IoOp* ops, int n) override {
    for (int i = 0; i < n; ++i) {
      zeroshard::offload::IoOp op = ops[i];
      FaultPlan& p = *plan_;
      if (!p.armed) {
        inner_->submit(&op, 1);
        continue;
      }
      const int nth = op.write ? p.writes++ : p.reads++;
      ++submitted_;
      if ((op.write && nth == p.fail_write_at) || (!op.write && nth == p.fail_read_at)) {
        fake(op.tag, -p.error);
        continue;
      }
      if (p.transient_every > 0 && submitted_ % p.transient_every == 0) {
        fake(op.tag, (submitted_ / p.transient_every) % 2 ? -EAGAIN : -EINTR);
        continue;
      }
      if (!op.write && nth == p.flip_read_at) flip_[op.tag] = op.buf;
      if (p.short_aligned && op.len > 4096) {
        op.len = (op.len / 2 + 4095) / 4096 * 4096;
        ++p.injected;
      }
      if (p.short_misaligned && op.len > 4096) shorten_[op.tag] = 100;
      inner_->submit(&op, 1);
    }
  }

  int reap(zeroshard::offload::IoCompletion* out, int max, int min) override {
    int got = 0;
    while (got < max && !fake_.empty()) {
      out[got++] = fake_.front();
      fake_.pop_front();
    }
    if (got < max) got += inner_->reap(out + got, max - got, got >= min ? 0 : min - got);
    for (int i = 0; i < got; ++i) {
      auto f = flip_.find(out[i].tag);
      if (f != flip_.end() && out[i].res > 0) {
        f->second[0] ^= 0x10;  // after the kernel wrote it: only the checksum can notice
        ++plan_->injected;
        flip_.erase(f);
      }
      auto s = shorten_.find(out[i].tag);
      if (s != shorten_.end()) {
        if (out[i].res > s->second) {
          out[i].res -= s->second;  // the remainder is misaligned: it must go the buffered way
          ++plan_->injected;
        }
        shorten_.erase(s);
      }
    }
    return got;
  }

 private:
  void fake(uint64_t tag, int res) {
    fake_.push_back({tag, res});
    ++plan_->injected;
  }
  std::unique_ptr<IoBackend> inner_;
  std::shared_ptr<FaultPlan> plan_;
  std::deque<zeroshard::offload::IoCompletion> fake_;
  std::map<uint64_t, char*> flip_;
  std::map<uint64_t, int> shorten_;
  int submitted_ = 0;
};

/// Installs a FaultBackend around every backend created while alive (and `preallocate`).
class InjectFaults {
 public:
  explicit InjectFaults(std::shared_ptr<FaultPlan> plan, bool preallocate = true) {
    zeroshard::offload::testing::Hooks h;
    h.wrap_backend = [plan](std::unique_ptr<zeroshard::offload::IoBackend> inner) {
      return std::unique_ptr<zeroshard::offload::IoBackend>(
          new FaultBackend(std::move(inner), plan));
    };
    h.preallocate = preallocate;
    zeroshard::offload::testing::set_hooks(h);
  }
  ~InjectFaults() { zeroshard::offload::testing::set_hooks({}); }
  InjectFaults(const InjectFaults&) = delete;
  InjectFaults& operator=(const InjectFaults&) = delete;
};

}  // namespace zs_fault
