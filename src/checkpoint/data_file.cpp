// Checkpoint data files (data_file.hpp).
#include "src/checkpoint/data_file.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "offload/checksum.hpp"
#include "src/base/check.hpp"

namespace zeroshard::ckpt {

namespace {
[[noreturn]] void io_failure(const std::filesystem::path& path, const char* what, int err) {
  if (err == ENOSPC || err == EDQUOT)
    ZS_THROW(no_space, "checkpoint: " << what << " " << path << ": " << std::strerror(err)
                                      << " (the disk is full)");
  ZS_THROW(io_error, "checkpoint: " << what << " " << path << ": " << std::strerror(err));
}

uint64_t table_sum(const std::vector<uint64_t>& sums) {
  return offload::xxh64(sums.data(), sums.size() * 8, ~uint64_t(0));
}
}  // namespace

DataFileWriter::DataFileWriter(std::filesystem::path path, const FileHeader& h)
    : path_(std::move(path)),
      h_(h),
      fd_(::open(path_.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644)),
      block_(size_t(h.block_bytes)) {
  if (!fd_) io_failure(path_, "creating", errno);
}

void DataFileWriter::write_at(const void* data, size_t bytes, int64_t offset) {
  const char* c = static_cast<const char*>(data);
  while (bytes > 0) {
    const ssize_t n = ::pwrite(fd_.get(), c, bytes, off_t(offset));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) io_failure(path_, "writing", errno);
    c += n, bytes -= size_t(n), offset += n;
  }
}

void DataFileWriter::flush_block() {
  if (filled_ == 0) return;
  sums_.push_back(offload::xxh64(block_.data(), filled_, uint64_t(sums_.size())));
  write_at(block_.data(), filled_, kHeaderBytes + written_);
  written_ += int64_t(filled_);
  filled_ = 0;
}

void DataFileWriter::append(const void* data, size_t bytes) {
  const char* c = static_cast<const char*>(data);
  while (bytes > 0) {
    const size_t n = std::min(bytes, block_.size() - filled_);
    std::memcpy(block_.data() + filled_, c, n);
    filled_ += n, c += n, bytes -= n;
    if (filled_ == block_.size()) flush_block();
  }
}

void DataFileWriter::finish() {
  flush_block();
  ZS_CHECK(written_ == h_.data_bytes);
  std::vector<uint64_t> table = sums_;
  table.push_back(table_sum(sums_));
  write_at(table.data(), table.size() * 8, kHeaderBytes + written_);
  const std::vector<char> header = encode_header(h_);
  write_at(header.data(), header.size(), 0);
  if (::fsync(fd_.get()) != 0) io_failure(path_, "fsync of", errno);
  fd_.reset();
}

DataFileReader::DataFileReader(std::filesystem::path path, const FileHeader& expected)
    : path_(std::move(path)), fd_(::open(path_.c_str(), O_RDONLY | O_CLOEXEC)) {
  if (!fd_) {
    if (errno == ENOENT)
      ZS_THROW(corrupted, "checkpoint: " << path_ << " is missing (the manifest lists it)");
    io_failure(path_, "opening", errno);
  }
  std::vector<char> header(static_cast<size_t>(kHeaderBytes));
  read_at(header.data(), header.size(), 0, "header");
  h_ = decode_header(header.data(), header.size(), path_.string());
  if (h_.save_id != expected.save_id || h_.rank != expected.rank || h_.state != expected.state)
    ZS_THROW(corrupted, "checkpoint: " << path_
                                       << " belongs to another save, rank or state than its "
                                          "manifest says (a file copied in from elsewhere?)");
  if (h_.data_bytes != expected.data_bytes || h_.block_bytes != expected.block_bytes)
    ZS_THROW(corrupted, "checkpoint: " << path_ << " holds " << h_.data_bytes
                                       << " bytes of data, its manifest says "
                                       << expected.data_bytes);
  const off_t end = ::lseek(fd_.get(), 0, SEEK_END);
  if (end < 0) io_failure(path_, "sizing", errno);
  if (int64_t(end) != file_bytes(h_))
    ZS_THROW(corrupted, "checkpoint: " << path_ << " is " << end << " bytes, expected "
                                       << file_bytes(h_) << " (truncated or extended)");
  sums_.resize(size_t(block_count(h_.data_bytes, h_.block_bytes)) + 1);
  read_at(sums_.data(), sums_.size() * 8, kHeaderBytes + h_.data_bytes, "checksum table");
  const uint64_t stored = sums_.back();
  sums_.pop_back();
  if (stored != table_sum(sums_))
    ZS_THROW(corrupted, "checkpoint: " << path_ << ": its checksum table is damaged (at offset "
                                       << kHeaderBytes + h_.data_bytes << ")");
  block_.resize(size_t(h_.block_bytes));
}

void DataFileReader::read_at(void* data, size_t bytes, int64_t offset, const char* what) {
  char* c = static_cast<char*>(data);
  while (bytes > 0) {
    const ssize_t n = ::pread(fd_.get(), c, bytes, off_t(offset));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) io_failure(path_, "reading", errno);
    if (n == 0)
      ZS_THROW(corrupted, "checkpoint: " << path_ << " ends before its " << what << " (offset "
                                         << offset << ")");
    c += n, bytes -= size_t(n), offset += n;
  }
}

int64_t DataFileReader::block_len(int64_t b) const {
  return std::min(h_.block_bytes, h_.data_bytes - b * h_.block_bytes);
}

void DataFileReader::load_block(int64_t b) {
  if (cached_ == b) return;
  cached_ = -1;
  const int64_t len = block_len(b), at = kHeaderBytes + b * h_.block_bytes;
  read_at(block_.data(), size_t(len), at, "data");
  if (offload::xxh64(block_.data(), size_t(len), uint64_t(b)) != sums_[size_t(b)])
    ZS_THROW(corrupted, "checkpoint: " << path_ << ": block " << b << " (" << len
                                       << " bytes at file offset " << at
                                       << ") fails its checksum: the file is damaged");
  cached_ = b;
}

void DataFileReader::read(int64_t offset, int64_t n, float* out) {
  int64_t byte = offset * 4;
  const int64_t end = (offset + n) * 4;
  ZS_CHECK(offset >= 0 && end <= h_.data_bytes);
  char* dst = reinterpret_cast<char*>(out);
  while (byte < end) {
    const int64_t b = byte / h_.block_bytes, in = byte - b * h_.block_bytes;
    load_block(b);
    const int64_t take = std::min(end - byte, block_len(b) - in);
    std::memcpy(dst, block_.data() + in, size_t(take));
    dst += take, byte += take;
  }
}

UnitReader::UnitReader(std::filesystem::path dir, const Manifest& m)
    : dir_(std::move(dir)), m_(m) {
  by_unit_.resize(m.units.size());
  for (size_t r = 0; r < m.ranges.size(); ++r) {
    int64_t n = 0;
    for (const Range& rg : m.ranges[r]) {
      by_unit_[size_t(rg.unit)].emplace_back(int(r), rg);
      n += rg.end - rg.begin;
    }
    data_bytes_.push_back(n * 4);
  }
}

void UnitReader::read(int s, int u, int64_t b, int64_t e, float* out) {
  for (const auto& [r, rg] : by_unit_[size_t(u)]) {
    const int64_t lo = std::max(b, rg.begin), hi = std::min(e, rg.end);
    if (lo < hi) file(r, s).read(rg.offset + (lo - rg.begin), hi - lo, out + (lo - b));
  }
}

DataFileReader& UnitReader::file(int r, int s) {
  std::unique_ptr<DataFileReader>& f = files_[{r, s}];
  if (!f)
    f = std::make_unique<DataFileReader>(
        dir_ / data_file_name(r, state_names()[size_t(s)].name),
        FileHeader{m_.save_id, r, s, m_.block_bytes, data_bytes_[size_t(r)]});
  return *f;
}

}  // namespace zeroshard::ckpt
