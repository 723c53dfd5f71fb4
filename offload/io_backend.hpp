#pragma once
// The I/O seam: the one interface the swapper calls to start and complete requests. The real
// implementation is io_uring (uring_backend.cpp); tests wrap it to inject EIO, short transfers,
// EAGAIN/EINTR and bit flips without mocking anything above it (see testing::Hooks).
//
// A backend is driven by one thread at a time (the IoQueue's I/O thread).

#include <sys/uio.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace zeroshard::offload {

/// One read or write request.
struct IoOp {
  uint64_t tag = 0;  ///< returned with the completion
  int file = 0;      ///< index into BackendSetup::fds
  bool write = false;
  char* buf = nullptr;  ///< inside a registered buffer when buf_index >= 0
  uint32_t len = 0;     ///< bytes
  uint64_t offset = 0;  ///< bytes from the start of the file
  int buf_index = -1;   ///< registered buffer holding [buf, buf + len), or -1
};

/// res: bytes transferred (possibly fewer than asked), or -errno.
struct IoCompletion {
  uint64_t tag = 0;
  int res = 0;
};

class IoBackend {
 public:
  virtual ~IoBackend() = default;
  /// Queues `n` requests; they start at the latest in the next reap(). The caller keeps at most
  /// depth() requests outstanding. Throws Error(io_error) only if the ring itself fails; a
  /// request's own failure comes back as its completion's res.
  virtual void submit(const IoOp* ops, int n) = 0;
  /// Starts queued requests, then stores up to `max` completions in `out`, blocking until at
  /// least `min` are available. Returns how many were stored.
  virtual int reap(IoCompletion* out, int max, int min) = 0;
  virtual int depth() const = 0;
};

struct BackendSetup {
  std::vector<int> fds;        ///< open files; IoOp::file indexes this table
  std::vector<iovec> buffers;  ///< staging memory to register (IoOp::buf_index indexes it)
  int queue_depth = 8;
};

/// An io_uring backend: a ring of queue_depth entries with the files and buffers registered
/// (fixed files, fixed buffers). If the kernel refuses a registration (RLIMIT_MEMLOCK for
/// unprivileged users, too many files) the ring still works with plain descriptors and buffers.
/// Throws Error(io_error) when io_uring is unavailable, naming the reason.
std::unique_ptr<IoBackend> make_uring_backend(const BackendSetup& setup);

/// make_uring_backend() passed through testing::Hooks::wrap_backend when one is set.
std::unique_ptr<IoBackend> make_backend(const BackendSetup& setup);

namespace testing {
/// Process-wide hooks for fault-injection tests; never set in production. Engines read them
/// when they create their swap files and ring (Engine::finalize()).
struct Hooks {
  /// Wraps every backend the swapper creates (to inject faults at the seam).
  std::function<std::unique_ptr<IoBackend>(std::unique_ptr<IoBackend>)> wrap_backend;
  /// false: leave swap files sparse, as on a file system without fallocate(), so a full disk
  /// shows up during a step instead of at finalize().
  bool preallocate = true;
};
void set_hooks(Hooks hooks);
Hooks hooks();
}  // namespace testing

}  // namespace zeroshard::offload
