#pragma once
// The per-run swap directory under one nvme path: <path>/zeroshard-<pid>-<seq>-rank<r>/, mode
// 0700, holding a "lock" file (0600) that stays flock-ed for the run's life and names the owner.
// A directory whose lock nobody holds was left by a run that did not exit cleanly: it is
// reported on stderr (one line naming it) and removed before this run creates its own; a
// directory is never reused. The destructor removes the directory (a clean exit).

#include <filesystem>
#include <string>

#include "base/unique_fd.hpp"

namespace zeroshard::offload {

class RunDir {
 public:
  RunDir() = default;
  /// Throws Error(io_error) naming `root` if it does not exist, is not a directory or is not
  /// writable. `rank` is only part of the name, so ranks sharing a path stay apart.
  RunDir(const std::filesystem::path& root, int rank);
  ~RunDir();
  RunDir(RunDir&& o) noexcept { swap(o); }
  RunDir& operator=(RunDir&& o) noexcept {
    RunDir t(std::move(o));
    swap(t);
    return *this;
  }
  RunDir(const RunDir&) = delete;
  RunDir& operator=(const RunDir&) = delete;

  const std::filesystem::path& path() const { return dir_; }
  const std::filesystem::path& root() const { return root_; }

  /// Removes stale run directories under `root` (any rank's); returns how many. Exposed for
  /// tests; the constructor calls it.
  static int clean_stale(const std::filesystem::path& root, int rank);

  /// A directory without a complete, unlocked lock file counts as stale only after this many
  /// seconds: younger ones may be in the middle of being created by a live run.
  static constexpr double kCreationGraceSeconds = 60.0;

 private:
  void swap(RunDir& o) noexcept;
  std::filesystem::path root_, dir_;
  UniqueFd lock_fd_;  // held (and flock-ed) for the run's life
};

}  // namespace zeroshard::offload
