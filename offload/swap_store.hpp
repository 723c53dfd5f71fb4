#pragma once
// One tier's swap space on this rank: one file per nvme path (never one per tensor), with a
// logical address space striped over the files in block_size stripes (RAID-0 style), so a large
// transfer keeps every path busy. The space is cut into fixed extents at set-up (one per unit
// and role, two for double-buffered records); each extent is split into pieces at stripe
// boundaries, and each piece has a checksum, kept in memory, written when the piece is written
// and verified when it is read back.

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include "base/unique_fd.hpp"
#include "offload/io_queue.hpp"
#include "offload/pinned_pool.hpp"
#include "offload/run_dir.hpp"

namespace zeroshard::offload {

class SwapStore {
 public:
  SwapStore() = default;
  /// `file_name` (e.g. "optim.swap") is created in each run directory; `label` names the
  /// tier in messages ("optimizer state"). block_size is a multiple of 4096.
  SwapStore(std::string label, std::string file_name, std::vector<const RunDir*> dirs,
            int64_t block_size);
  /// Closes and removes the files. Never throws.
  ~SwapStore();
  SwapStore(SwapStore&& o) noexcept { swap(o); }
  SwapStore& operator=(SwapStore&& o) noexcept {
    SwapStore t(std::move(o));
    swap(t);
    return *this;
  }
  SwapStore(const SwapStore&) = delete;
  SwapStore& operator=(const SwapStore&) = delete;

  /// Reserves an extent of `bytes` (rounded up to 4096); before open(). Returns its id.
  int add_extent(uint64_t bytes);
  /// Creates the files (O_DIRECT, mode 0600, O_EXCL) and reserves their space with fallocate()
  /// unless `preallocate` is false (or the file system cannot), when they stay sparse. Throws
  /// Error(no_space) or Error(io_error) naming the file; created files are removed again.
  void open(bool preallocate);

  /// File descriptors to register with the I/O queue: the O_DIRECT ones, then the buffered ones
  /// (the same descriptor again where the file system cannot do O_DIRECT).
  std::vector<int> fds() const;
  std::vector<std::string> file_names() const;
  /// Where fds()[0] lands in the queue's file table.
  void set_file_base(int base) { file_base_ = base; }

  /// Appends the pieces that move extent `e` (all of it) between the file and `buf`.
  /// `pool` (may be null) supplies registered-buffer indices.
  void pieces(int e, char* buf, const PinnedPool* pool, bool write, std::vector<Piece>& out);

  /// Extent `e` into `buf` (4096-aligned) now, with positioned reads on the calling thread
  /// instead of the I/O queue (for a thread of its own; the extent must not be written
  /// meanwhile), each piece verified against its checksum. Throws Error(io_error) or
  /// Error(corrupted) naming the file and offset.
  void read_now(int e, char* buf) const;

  uint64_t extent_bytes(int e) const { return extents_[size_t(e)].bytes; }
  /// Bytes of all files together (what the tier occupies on disk).
  uint64_t file_bytes() const { return file_bytes_ * files_.size(); }
  const std::vector<std::filesystem::path>& paths() const { return paths_; }
  const std::string& label() const { return label_; }

 private:
  struct Extent {
    uint64_t offset = 0, bytes = 0;  // logical
    std::vector<uint64_t> sums;      // one per piece
  };
  // The swap file on one nvme path (a 1/P share of the stripes), open twice: O_DIRECT for
  // whole-block requests, through the page cache for the unaligned rest. Where the file system
  // cannot do O_DIRECT, `direct` is a buffered descriptor and `buffered` stays empty.
  struct StripeFile {
    UniqueFd direct, buffered;
    int buffered_fd() const { return buffered ? buffered.get() : direct.get(); }
  };
  void swap(SwapStore& o) noexcept;
  void close_all() noexcept;
  template <class F>
  void each_piece(const Extent& e, F&& f) const;

  std::string label_, file_name_;
  std::vector<std::filesystem::path> paths_;
  std::vector<StripeFile> files_;
  std::vector<Extent> extents_;
  uint64_t block_ = 1 << 20;
  uint64_t end_ = 0;         // logical bytes allocated
  uint64_t file_bytes_ = 0;  // size of each file
  int file_base_ = 0;
};

}  // namespace zeroshard::offload
