// The io_uring backend of the I/O seam. Every liburing call's result is checked; a failing
// request is not an exception here but its completion's res, which the IoQueue interprets.
#include <chrono>
#include <mutex>
#include <thread>

#include "base/check.hpp"
#include "offload/io_backend.hpp"

#ifdef ZEROSHARD_HAVE_URING
#include <liburing.h>
#endif

namespace zeroshard::offload {

namespace testing {
namespace {
std::mutex g_hooks_mu;
Hooks g_hooks;  // test-only seam; see io_backend.hpp
}  // namespace
void set_hooks(Hooks h) {
  std::lock_guard<std::mutex> lock(g_hooks_mu);
  g_hooks = std::move(h);
}
Hooks hooks() {
  std::lock_guard<std::mutex> lock(g_hooks_mu);
  return g_hooks;
}
}  // namespace testing

std::unique_ptr<IoBackend> make_backend(const BackendSetup& setup) {
  std::unique_ptr<IoBackend> b = make_uring_backend(setup);
  testing::Hooks h = testing::hooks();
  return h.wrap_backend ? h.wrap_backend(std::move(b)) : std::move(b);
}

#ifdef ZEROSHARD_HAVE_URING

namespace {

// liburing returns -errno instead of setting errno.
#define ZS_CHECK_URING(expr, what)                                                              \
  do {                                                                                          \
    int zs_r_ = (expr);                                                                         \
    if (zs_r_ < 0) ZS_THROW(io_error, what << ": " #expr " failed: " << std::strerror(-zs_r_)); \
  } while (0)

class UringBackend final : public IoBackend {
 public:
  explicit UringBackend(const BackendSetup& s) : fds_(s.fds), depth_(std::max(1, s.queue_depth)) {
    ZS_CHECK_URING(io_uring_queue_init(unsigned(depth_), &ring_, 0),
                   "nvme swap: cannot create an io_uring of " << depth_ << " entries");
    // Registration saves the kernel a file lookup and a page pinning per request. It is an
    // optimisation: on refusal (memlock limit, old kernel) requests use plain fds and buffers.
    if (!fds_.empty())
      files_ = io_uring_register_files(&ring_, fds_.data(), unsigned(fds_.size())) == 0;
    if (!s.buffers.empty())
      buffers_ =
          io_uring_register_buffers(&ring_, s.buffers.data(), unsigned(s.buffers.size())) == 0;
  }
  ~UringBackend() override { io_uring_queue_exit(&ring_); }  // also unregisters
  UringBackend(const UringBackend&) = delete;
  UringBackend& operator=(const UringBackend&) = delete;

  int depth() const override { return depth_; }

  void submit(const IoOp* ops, int n) override {
    for (int i = 0; i < n; ++i) {
      io_uring_sqe* sqe = io_uring_get_sqe(&ring_);
      if (!sqe) {  // the caller keeps at most depth() in flight, so this means a full SQ: flush
        flush();
        sqe = io_uring_get_sqe(&ring_);
        ZS_CHECK(sqe != nullptr);
      }
      const IoOp& op = ops[i];
      const int fd = files_ ? op.file : fds_[size_t(op.file)];
      if (buffers_ && op.buf_index >= 0) {
        if (op.write)
          io_uring_prep_write_fixed(sqe, fd, op.buf, op.len, op.offset, op.buf_index);
        else
          io_uring_prep_read_fixed(sqe, fd, op.buf, op.len, op.offset, op.buf_index);
      } else if (op.write) {
        io_uring_prep_write(sqe, fd, op.buf, op.len, op.offset);
      } else {
        io_uring_prep_read(sqe, fd, op.buf, op.len, op.offset);
      }
      if (files_) sqe->flags |= IOSQE_FIXED_FILE;
      io_uring_sqe_set_data64(sqe, op.tag);
    }
    // Not submitted yet: reap() submits and waits in one system call.
  }

  int reap(IoCompletion* out, int max, int min) override {
    if (io_uring_sq_ready(&ring_) > 0) {
      if (min > 0) {
        int r;
        do r = io_uring_submit_and_wait(&ring_, 1);
        while (r == -EINTR);
        if (r == -EAGAIN || r == -EBUSY)
          flush();  // transient: the retrying path
        else
          ZS_CHECK_URING(r, "nvme swap: io_uring_submit_and_wait");
      } else {
        flush();
      }
    }
    int got = 0;
    while (got < max) {
      io_uring_cqe* cqe = nullptr;
      int r = got < min ? io_uring_wait_cqe(&ring_, &cqe) : io_uring_peek_cqe(&ring_, &cqe);
      if (r == -EINTR) continue;              // a signal interrupted the wait: wait again
      if (r == -EAGAIN && got >= min) break;  // nothing more ready, and enough reaped
      ZS_CHECK_URING(r, "nvme swap: waiting for io_uring completions");
      out[got++] = {io_uring_cqe_get_data64(cqe), cqe->res};
      io_uring_cqe_seen(&ring_, cqe);
    }
    return got;
  }

 private:
  // Submits everything queued; the kernel may take fewer than queued, or be interrupted.
  // Transient refusals (EAGAIN: no kernel memory for now) are retried for about a second.
  void flush() {
    for (int tries = 0; io_uring_sq_ready(&ring_) > 0;) {
      int r = io_uring_submit(&ring_);
      if (r == -EINTR) continue;
      if ((r == -EAGAIN || r == -EBUSY) && ++tries < 10000) {
        std::this_thread::sleep_for(std::chrono::microseconds(100));
        continue;
      }
      ZS_CHECK_URING(r, "nvme swap: io_uring_submit");
    }
  }

  io_uring ring_{};
  std::vector<int> fds_;
  int depth_;
  bool files_ = false, buffers_ = false;
};

}  // namespace

std::unique_ptr<IoBackend> make_uring_backend(const BackendSetup& setup) {
  return std::make_unique<UringBackend>(setup);
}

#else

std::unique_ptr<IoBackend> make_uring_backend(const BackendSetup&) {
  ZS_THROW(io_error,
           "nvme swap: this zeroshard was built without io_uring (ZEROSHARD_WITH_URING=OFF)");
}

#endif

}  // namespace zeroshard::offload
