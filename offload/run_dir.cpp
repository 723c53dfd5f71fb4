#include "offload/run_dir.hpp"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <ctime>

#include "base/check.hpp"

namespace zeroshard::offload {
namespace fs = std::filesystem;

namespace {

std::atomic<int> g_seq{0};  // distinguishes the engines of one process

// Seconds since `p` was last modified (creation of its entries counts); 0 if it is gone (another
// run's scan removed it meanwhile: nothing left to do).
double age_seconds(const fs::path& p) {
  struct stat st {};
  if (::stat(p.c_str(), &st) != 0) return 0;
  return std::difftime(std::time(nullptr), st.st_mtime);
}

std::string read_small(int fd) {
  char buf[256];
  ssize_t n = ::pread(fd, buf, sizeof buf - 1, 0);
  if (n <= 0) return {};
  std::string s(buf, size_t(n));
  while (!s.empty() && (s.back() == '\n' || s.back() == '\0')) s.pop_back();
  return s;
}

// Whether `name` reads "zeroshard-<digits>-<digits>-rank<digits>", the shape of a run directory.
bool is_run_dir_name(const std::string& name) {
  size_t i = 0;
  auto lit = [&](const char* t) {
    const size_t n = std::strlen(t);
    if (name.compare(i, n, t) != 0) return false;
    i += n;
    return true;
  };
  auto digits = [&] {
    const size_t b = i;
    while (i < name.size() && name[i] >= '0' && name[i] <= '9') ++i;
    return i > b;
  };
  return lit("zeroshard-") && digits() && lit("-") && digits() && lit("-rank") && digits() &&
         i == name.size();
}

}  // namespace

int RunDir::clean_stale(const fs::path& root, int rank) {
  std::error_code ec;
  int removed = 0;
  for (fs::directory_iterator it(root, ec), end; !ec && it != end; it.increment(ec)) {
    const fs::path dir = it->path();
    if (!is_run_dir_name(dir.filename().string()) || !it->is_directory(ec)) continue;
    // A live run holds an exclusive flock on its lock file for its whole life; the kernel drops
    // it when the process dies, however it dies.
    // The lock (if taken) is kept until the directory is gone, so no other scan races with us.
    const UniqueFd fd(::open((dir / "lock").c_str(), O_RDWR | O_CLOEXEC));
    std::string owner;
    if (fd) {
      if (::flock(fd.get(), LOCK_EX | LOCK_NB) != 0) continue;  // held: a live run
      owner = read_small(fd.get());
    }
    // No lock file, or one without its owner line yet: perhaps a run being created right now.
    if (owner.empty() && age_seconds(dir) < kCreationGraceSeconds) continue;
    std::fprintf(stderr,
                 "zeroshard: rank %d: removing swap directory %s left by a run that did not exit "
                 "cleanly (%s)\n",
                 rank, dir.c_str(), owner.empty() ? "no owner recorded" : owner.c_str());
    fs::remove_all(dir, ec);
    if (ec)
      std::fprintf(stderr, "zeroshard: rank %d: could not remove %s: %s\n", rank, dir.c_str(),
                   ec.message().c_str());
    ec.clear();
    ++removed;
  }
  return removed;
}

RunDir::RunDir(const fs::path& root, int rank) : root_(root) {
  struct stat st {};
  if (::stat(root.c_str(), &st) != 0) {
    int e = errno;
    ZS_THROW(io_error, "rank " << rank << ": nvme path '" << root.string()
                               << "' cannot be used: " << std::strerror(e));
  }
  if (!S_ISDIR(st.st_mode))
    ZS_THROW(io_error,
             "rank " << rank << ": nvme path '" << root.string() << "' is not a directory");
  clean_stale(root, rank);

  const std::string name = "zeroshard-" + std::to_string(::getpid()) + "-" +
                           std::to_string(g_seq++) + "-rank" + std::to_string(rank);
  dir_ = root / name;
  if (::mkdir(dir_.c_str(), 0700) != 0) {
    int e = errno;
    if (e != EEXIST)
      ZS_THROW(io_error, "rank " << rank << ": nvme path '" << root.string()
                                 << "' is not writable: cannot create " << dir_.string() << ": "
                                 << std::strerror(e));
    // Our pid and sequence number: a dead process with this pid left it. Never reuse it.
    std::fprintf(
        stderr,
        "zeroshard: rank %d: removing swap directory %s left by an earlier process with this pid\n",
        rank, dir_.c_str());
    std::error_code ec;
    fs::remove_all(dir_, ec);
    ZS_CHECK_SYS(::mkdir(dir_.c_str(), 0700), "rank " << rank << ": creating " << dir_.string());
  }
  // Set the modes exactly, whatever the umask.
  ZS_CHECK_SYS(::chmod(dir_.c_str(), 0700), "rank " << rank << ": chmod " << dir_.string());
  // The lock file is locked and filled under a temporary name, then renamed into place (the
  // flock stays with the file): another run's scan never sees it unlocked or empty.
  const fs::path lock = dir_ / "lock", tmp = dir_ / "lock.tmp";
  lock_fd_.reset(::open(tmp.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600));
  if (!lock_fd_) {
    int e = errno;
    std::error_code ec;
    fs::remove_all(dir_, ec);
    ZS_THROW(io_error,
             "rank " << rank << ": creating " << tmp.string() << ": " << std::strerror(e));
  }
  auto fail = [&](const char* what) {
    int e = errno;
    lock_fd_.reset();
    std::error_code ec;
    fs::remove_all(dir_, ec);
    ZS_THROW(io_error,
             "rank " << rank << ": " << what << " " << lock.string() << ": " << std::strerror(e));
  };
  if (::fchmod(lock_fd_.get(), 0600) != 0) fail("chmod");
  if (::flock(lock_fd_.get(), LOCK_EX | LOCK_NB) != 0) fail("locking");
  char host[128] = "?";
  ::gethostname(host, sizeof host - 1);
  const std::string owner = "pid " + std::to_string(::getpid()) + " on " + host + ", rank " +
                            std::to_string(rank) + ", started " +
                            std::to_string(long(std::time(nullptr))) + "\n";
  if (::pwrite(lock_fd_.get(), owner.data(), owner.size(), 0) != ssize_t(owner.size()))
    fail("writing");
  if (::rename(tmp.c_str(), lock.c_str()) != 0) fail("renaming");
}

RunDir::~RunDir() {
  if (!lock_fd_) return;
  // Remove everything while still holding the lock, so no other run's scan races with us.
  std::error_code ec;
  fs::remove_all(dir_, ec);
  if (ec)
    std::fprintf(stderr, "zeroshard: could not remove swap directory %s: %s\n", dir_.c_str(),
                 ec.message().c_str());
}  // lock_fd_ closes last, releasing the lock

void RunDir::swap(RunDir& o) noexcept {
  std::swap(root_, o.root_);
  std::swap(dir_, o.dir_);
  std::swap(lock_fd_, o.lock_fd_);
}

}  // namespace zeroshard::offload
