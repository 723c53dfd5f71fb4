// Positioned whole transfers (file_io.hpp).
#include "src/checkpoint/file_io.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "base/check.hpp"
#include "base/unique_fd.hpp"

namespace zeroshard::ckpt {

void io_failure(const std::filesystem::path& path, const char* what, int err) {
  if (err == ENOSPC || err == EDQUOT)
    ZS_THROW(no_space, "checkpoint: " << what << " " << path << ": " << std::strerror(err)
                                      << " (the disk is full)");
  ZS_THROW(io_error, "checkpoint: " << what << " " << path << ": " << std::strerror(err));
}

void pwrite_all(int fd, const void* data, size_t bytes, int64_t offset,
                const std::filesystem::path& path) {
  const char* c = static_cast<const char*>(data);
  while (bytes > 0) {
    const ssize_t n = ::pwrite(fd, c, bytes, off_t(offset));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) io_failure(path, "writing", errno);
    c += n, bytes -= size_t(n), offset += n;
  }
}

void pread_all(int fd, void* data, size_t bytes, int64_t offset, const std::filesystem::path& path,
               const char* what) {
  char* c = static_cast<char*>(data);
  while (bytes > 0) {
    const ssize_t n = ::pread(fd, c, bytes, off_t(offset));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) io_failure(path, "reading", errno);
    if (n == 0)
      ZS_THROW(corrupted, "checkpoint: " << path << " ends before its " << what << " (offset "
                                         << offset << ")");
    c += n, bytes -= size_t(n), offset += n;
  }
}

int open_regular(const std::filesystem::path& path, int flags) {
  // O_NONBLOCK: opening a FIFO for reading would wait for a writer.
  UniqueFd fd(::open(path.c_str(), flags | O_NONBLOCK | O_CLOEXEC));
  if (!fd) {
    if (errno == ENOENT || errno == ENOTDIR) return -1;
    io_failure(path, "opening", errno);
  }
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0) io_failure(path, "inspecting", errno);
  if (!S_ISREG(st.st_mode))
    ZS_THROW(corrupted, "checkpoint: " << path
                                       << " is not a regular file (a directory, FIFO, "
                                          "device or socket): refused");
  const int fl = ::fcntl(fd.get(), F_GETFL);
  if (fl < 0 || ::fcntl(fd.get(), F_SETFL, fl & ~O_NONBLOCK) != 0)
    io_failure(path, "opening", errno);
  return fd.release();
}

namespace {
void check_ec(const std::error_code& ec, const std::filesystem::path& path, const char* what) {
  if (ec) io_failure(path, what, ec.value());
}
}  // namespace

void make_directories(const std::filesystem::path& path) {
  std::error_code ec;
  std::filesystem::create_directories(path, ec);
  check_ec(ec, path, "creating directory");
}

void make_directory(const std::filesystem::path& path) {
  std::error_code ec;
  std::filesystem::create_directory(path, ec);
  check_ec(ec, path, "creating directory");
}

void rename_path(const std::filesystem::path& from, const std::filesystem::path& to) {
  std::error_code ec;
  std::filesystem::rename(from, to, ec);
  check_ec(ec, to, "renaming into");
}

void fsync_fd(int fd, const std::filesystem::path& path) {
  if (::fsync(fd) != 0) io_failure(path, "fsync of", errno);
}

void fsync_path(const std::filesystem::path& path) {
  UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (!fd) io_failure(path, "opening", errno);
  fsync_fd(fd.get(), path);
}

}  // namespace zeroshard::ckpt
