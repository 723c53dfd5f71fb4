#include "offload/swap_store.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>

#include "base/check.hpp"
#include "base/checksum.hpp"

namespace zeroshard::offload {

static uint64_t align_up(uint64_t n, uint64_t a) {
  return (n + a - 1) / a * a;
}

SwapStore::SwapStore(std::string label, std::string file_name, std::vector<const RunDir*> dirs,
                     int64_t block_size)
    : label_(std::move(label)), file_name_(std::move(file_name)), block_(uint64_t(block_size)) {
  ZS_CHECK(block_size > 0 && block_size % 4096 == 0 && !dirs.empty());
  for (const RunDir* d : dirs) paths_.push_back(d->path() / file_name_);
}

SwapStore::~SwapStore() {
  close_all();
}

void SwapStore::swap(SwapStore& o) noexcept {
  std::swap(label_, o.label_);
  std::swap(file_name_, o.file_name_);
  std::swap(paths_, o.paths_);
  std::swap(files_, o.files_);
  std::swap(extents_, o.extents_);
  std::swap(block_, o.block_);
  std::swap(end_, o.end_);
  std::swap(file_bytes_, o.file_bytes_);
  std::swap(file_base_, o.file_base_);
}

void SwapStore::close_all() noexcept {
  for (size_t i = 0; i < files_.size(); ++i) ::unlink(paths_[i].c_str());
  files_.clear();  // closes every descriptor
}

int SwapStore::add_extent(uint64_t bytes) {
  ZS_CHECK(files_.empty());
  bytes = align_up(bytes, 4096);
  // Large extents start on a stripe so their requests are whole blocks; small ones pack tightly.
  end_ = align_up(end_, bytes >= block_ ? block_ : 4096);
  Extent e;
  e.offset = end_;
  e.bytes = bytes;
  uint64_t n = 0;
  for (uint64_t o = e.offset; o < e.offset + bytes; o = (o / block_ + 1) * block_) ++n;
  e.sums.assign(size_t(n), 0);
  end_ += bytes;
  extents_.push_back(std::move(e));
  return int(extents_.size()) - 1;
}

void SwapStore::open(bool preallocate) {
  ZS_CHECK(files_.empty());
  const uint64_t P = paths_.size();
  // Stripe s lives in file s % P at offset (s / P) × block: each file holds a 1/P share.
  file_bytes_ = align_up(end_, P * block_) / P;
  files_.resize(paths_.size());
  for (size_t i = 0; i < P; ++i) {
    const char* path = paths_[i].c_str();
    StripeFile& f = files_[i];
    auto fail = [&](ErrorCode code, const std::string& what, int e) {
      std::string msg = "nvme swap (" + label_ + "): " + what + " " + paths_[i].string() + ": " +
                        std::strerror(e);
      close_all();
      throw Error(code, msg);
    };
    f.direct.reset(::open(path, O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC | O_DIRECT, 0600));
    if (!f.direct && errno == EINVAL) {
      // The file system cannot do O_DIRECT (some FUSE and overlay mounts): correct but slower.
      std::fprintf(stderr,
                   "zeroshard: %s does not support O_DIRECT; swapping through the page cache\n",
                   path);
      f.direct.reset(::open(path, O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600));
      if (!f.direct) fail(ErrorCode::io_error, "cannot create", errno);
    } else {
      if (!f.direct) fail(ErrorCode::io_error, "cannot create", errno);
      f.buffered.reset(::open(path, O_RDWR | O_CLOEXEC));
      if (!f.buffered) fail(ErrorCode::io_error, "cannot open", errno);
    }
    if (::fchmod(f.direct.get(), 0600) != 0) fail(ErrorCode::io_error, "cannot chmod", errno);
    if (file_bytes_ == 0) continue;
    // Reserve the space now, so a full disk shows at finalize() and never in the middle of a step.
    int r = preallocate ? ::fallocate(f.direct.get(), 0, 0, off_t(file_bytes_)) : -1;
    int e = preallocate ? errno : EOPNOTSUPP;
    if (r != 0 && (e == ENOSPC || e == EDQUOT))
      fail(ErrorCode::no_space, "cannot reserve " + std::to_string(file_bytes_) + " bytes for", e);
    if (r != 0 && e != EOPNOTSUPP) fail(ErrorCode::io_error, "cannot reserve space for", e);
    if (r != 0 && ::ftruncate(f.direct.get(), off_t(file_bytes_)) != 0)
      fail(ErrorCode::io_error, "cannot size", errno);
  }
}

std::vector<int> SwapStore::fds() const {
  std::vector<int> v;
  for (const StripeFile& f : files_) v.push_back(f.direct.get());
  for (const StripeFile& f : files_) v.push_back(f.buffered_fd());
  return v;
}

std::vector<std::string> SwapStore::file_names() const {
  std::vector<std::string> v;
  for (const auto& p : paths_) v.push_back(p.string());
  for (const auto& p : paths_) v.push_back(p.string() + " (buffered)");
  return v;
}

// f(k, file, offset, len, o): piece k of extent e, on stripe file `file` at `offset`, holding
// the extent's logical bytes [o, o + len). Pieces end at stripe boundaries.
template <class F>
void SwapStore::each_piece(const Extent& e, F&& f) const {
  const uint64_t P = files_.size();
  size_t k = 0;
  for (uint64_t o = e.offset; o < e.offset + e.bytes; ++k) {
    const uint64_t stripe = o / block_, next = std::min(e.offset + e.bytes, (stripe + 1) * block_);
    f(k, size_t(stripe % P), (stripe / P) * block_ + o % block_, uint32_t(next - o), o);
    o = next;
  }
}

void SwapStore::pieces(int id, char* buf, const PinnedPool* pool, bool write,
                       std::vector<Piece>& out) {
  Extent& e = extents_[size_t(id)];
  const int P = int(files_.size());
  each_piece(e, [&](size_t k, size_t file, uint64_t offset, uint32_t len, uint64_t o) {
    Piece p;
    p.file = file_base_ + int(file);
    p.fallback_file = file_base_ + P + int(file);
    p.offset = offset;
    p.len = len;
    p.write = write;
    p.buf = buf + (o - e.offset);
    p.buf_index = pool ? pool->buf_index(p.buf, p.len) : -1;
    p.checksum = &e.sums[k];
    p.seed = o;
    out.push_back(p);
  });
}

void SwapStore::read_now(int id, char* buf) const {
  const Extent& e = extents_[size_t(id)];
  each_piece(e, [&](size_t k, size_t file, uint64_t offset, uint32_t len, uint64_t o) {
    char* into = buf + (o - e.offset);
    const bool aligned = (reinterpret_cast<uintptr_t>(into) | offset | len) % 4096 == 0;
    const int fd = aligned ? files_[file].direct.get() : files_[file].buffered_fd();
    for (uint32_t got = 0; got < len;) {
      const ssize_t n = ::pread(fd, into + got, len - got, off_t(offset + got));
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0)
        ZS_THROW(io_error, label_ << ": read of " << len << " bytes at offset " << offset << " of "
                                  << paths_[file] << ": "
                                  << (n < 0 ? std::strerror(errno) : "the file ends there"));
      got += uint32_t(n);
    }
    if (xxh64(into, len, o) != e.sums[k])
      ZS_THROW(corrupted, label_ << ": read of " << len << " bytes at offset " << offset << " of "
                                 << paths_[file]
                                 << ": checksum mismatch: the data read back is not what was "
                                    "written (the swap file was corrupted)");
  });
}

}  // namespace zeroshard::offload
