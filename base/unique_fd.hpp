#pragma once
// UniqueFd: the one move-only owner of a POSIX file descriptor (docs/DESIGN.md rule 3). It closes
// the descriptor when destroyed or reset; close() errors are ignored there, since a destructor must
// not throw and by then nothing can be done about them (data that must be durable is fsync'ed,
// and checked, before).

#include <unistd.h>

#include <utility>

namespace zeroshard {

class UniqueFd {
 public:
  UniqueFd() = default;
  /// Takes ownership of `fd` (a negative value means none, as open() returns on failure).
  explicit UniqueFd(int fd) noexcept : fd_(fd < 0 ? -1 : fd) {}
  ~UniqueFd() { reset(); }
  UniqueFd(UniqueFd&& o) noexcept : fd_(std::exchange(o.fd_, -1)) {}
  UniqueFd& operator=(UniqueFd&& o) noexcept {
    if (this != &o) reset(std::exchange(o.fd_, -1));
    return *this;
  }
  UniqueFd(const UniqueFd&) = delete;
  UniqueFd& operator=(const UniqueFd&) = delete;

  int get() const noexcept { return fd_; }
  explicit operator bool() const noexcept { return fd_ >= 0; }
  /// Closes the descriptor held (if any) and takes `fd` instead.
  void reset(int fd = -1) noexcept {
    if (fd_ >= 0) (void)::close(fd_);
    fd_ = fd < 0 ? -1 : fd;
  }
  /// Gives up ownership without closing.
  int release() noexcept { return std::exchange(fd_, -1); }

 private:
  int fd_ = -1;
};

}  // namespace zeroshard
