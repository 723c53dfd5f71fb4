// Checkpoint data files (data_file.hpp).
#include "src/checkpoint/data_file.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <new>

#include "base/check.hpp"
#include "base/checksum.hpp"
#include "src/checkpoint/encoding.hpp"
#include "src/checkpoint/file_io.hpp"

namespace zeroshard::ckpt {

namespace {

constexpr size_t kAlign = 4096;  // O_DIRECT's alignment of offsets, lengths and memory

uint64_t table_sum(const std::vector<uint64_t>& sums) {
  return offload::xxh64(sums.data(), sums.size() * 8, ~uint64_t(0));
}
}  // namespace

BlockBuffer::BlockBuffer(size_t bytes) {
  constexpr size_t kHugeAlign = size_t(2) << 20;
  const size_t rounded = (bytes + kHugeAlign - 1) / kHugeAlign * kHugeAlign;
  data = static_cast<char*>(std::aligned_alloc(kHugeAlign, rounded));
  if (!data) throw std::bad_alloc();
  (void)madvise(data, rounded, MADV_HUGEPAGE);  // a hint: fine if refused
}

BlockBuffer::~BlockBuffer() {
  std::free(data);
}

struct DataFileWriter::Block : BlockBuffer {
  using BlockBuffer::BlockBuffer;
  size_t len = 0;
  int64_t index = 0;
};

DataFileWriter::DataFileWriter(std::filesystem::path path, const FileHeader& h)
    : path_(std::move(path)),
      h_(h),
      fd_(::open(path_.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644)) {
  if (!fd_) io_failure(path_, "creating", errno);
  // A second descriptor with O_DIRECT for the aligned blocks (tmpfs, for one, may refuse it:
  // then everything goes through the page cache).
  direct_fd_.reset(::open(path_.c_str(), O_WRONLY | O_DIRECT | O_CLOEXEC));
  ZS_CHECK(h.block_bytes % int64_t(kAlign) == 0);
  for (size_t i = 0; i < kWriters + 2; ++i)
    free_.push_back(std::make_unique<Block>(size_t(h.block_bytes)));
  filling_ = std::move(free_.back());
  free_.pop_back();
  try {
    for (size_t i = 0; i < kWriters; ++i) threads_.emplace_back([this] { run(); });
  } catch (...) {  // the destructor does not run: stop the threads that started
    stop();
    throw;
  }
}

DataFileWriter::~DataFileWriter() {
  stop();
}

void DataFileWriter::stop() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  for (std::thread& t : threads_) t.join();
  threads_.clear();
}

void DataFileWriter::write_at(const void* data, size_t bytes, int64_t offset, bool direct) {
  pwrite_all(direct && direct_fd_ ? direct_fd_.get() : fd_.get(), data, bytes, offset, path_);
}

void DataFileWriter::rethrow() {
  std::lock_guard<std::mutex> lock(mu_);
  if (error_) std::rethrow_exception(error_);
}

// Checksums and writes queued blocks, kWriters of them at a time (each thread one). A block
// shorter than the others (the last) is written padded to the alignment; finish() then writes
// the table over the padding.
void DataFileWriter::run() {
  for (;;) {
    std::unique_ptr<Block> b;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return stop_ || !queued_.empty(); });
      if (queued_.empty()) return;
      b = std::move(queued_.front());
      queued_.erase(queued_.begin());
    }
    try {
      const uint64_t sum = offload::xxh64(b->data, b->len, uint64_t(b->index));
      const size_t padded = (b->len + kAlign - 1) / kAlign * kAlign;
      std::memset(b->data + b->len, 0, padded - b->len);
      write_at(b->data, padded, kHeaderBytes + b->index * h_.block_bytes, true);
      std::lock_guard<std::mutex> lock(mu_);
      if (sums_.size() <= size_t(b->index)) sums_.resize(size_t(b->index) + 1);
      sums_[size_t(b->index)] = sum;
    } catch (...) {
      std::lock_guard<std::mutex> lock(mu_);
      if (!error_) error_ = std::current_exception();
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      free_.push_back(std::move(b));
    }
    cv_.notify_all();
  }
}

void DataFileWriter::hand_over() {
  filling_->index = blocks_++;
  std::unique_lock<std::mutex> lock(mu_);
  queued_.push_back(std::move(filling_));
  cv_.notify_all();
  cv_.wait(lock, [&] { return !free_.empty() || error_; });
  if (error_) std::rethrow_exception(error_);
  filling_ = std::move(free_.back());
  free_.pop_back();
  filling_->len = 0;
}

void DataFileWriter::append(const void* data, size_t bytes) {
  const char* c = static_cast<const char*>(data);
  while (bytes > 0) {
    const size_t n = std::min(bytes, size_t(h_.block_bytes) - filling_->len);
    std::memcpy(filling_->data + filling_->len, c, n);
    filling_->len += n, c += n, bytes -= n, written_ += int64_t(n);
    if (filling_->len == size_t(h_.block_bytes)) hand_over();
  }
}

void DataFileWriter::finish() {
  ZS_CHECK(written_ == h_.data_bytes);
  if (filling_->len > 0) hand_over();
  {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return (queued_.empty() && free_.size() == kWriters + 1) || error_; });
  }
  rethrow();
  std::vector<uint64_t> table = sums_;
  table.push_back(table_sum(sums_));
  write_at(table.data(), table.size() * 8, kHeaderBytes + h_.data_bytes, false);
  const std::vector<char> header = encode_header(h_);
  write_at(header.data(), header.size(), 0, false);
  if (::ftruncate(fd_.get(), off_t(file_bytes(h_))) != 0) io_failure(path_, "sizing", errno);
  fsync_fd(fd_.get(), path_);
}

DataFileReader::DataFileReader(std::filesystem::path path, const FileHeader& expected)
    : path_(std::move(path)), fd_(open_regular(path_, O_RDONLY)) {
  if (!fd_) ZS_THROW(corrupted, "checkpoint: " << path_ << " is missing (the manifest lists it)");
  std::vector<char> header(static_cast<size_t>(kHeaderBytes));
  read_at(header.data(), header.size(), 0, "header");
  h_ = decode_header(header.data(), header.size(), path_.string());
  // Each field that differs, named with both values.
  std::string differs;
  auto field = [&](const char* name, auto got, auto want) {
    if (got == want) return;
    differs += std::string(differs.empty() ? "" : "; ") + name + " " + std::to_string(got) +
               ", its manifest says " + std::to_string(want);
  };
  field("save id", h_.save_id, expected.save_id);
  field("rank", h_.rank, expected.rank);
  field("state", h_.state, expected.state);
  if (!differs.empty())
    ZS_THROW(corrupted, "checkpoint: " << path_ << " belongs to another save, rank or state ("
                                       << differs << "): a file copied in from elsewhere?");
  field("bytes of data", h_.data_bytes, expected.data_bytes);
  field("block_bytes", h_.block_bytes, expected.block_bytes);
  if (!differs.empty()) ZS_THROW(corrupted, "checkpoint: " << path_ << " holds " << differs);
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
  direct_fd_.reset(::open(path_.c_str(), O_RDONLY | O_DIRECT | O_CLOEXEC));
}

void DataFileReader::read_at(void* data, size_t bytes, int64_t offset, const char* what) const {
  pread_all(fd_.get(), data, bytes, offset, path_, what);
}

void DataFileReader::verify(int64_t b, const char* data) const {
  const int64_t len = block_len(b);
  if (offload::xxh64(data, size_t(len), uint64_t(b)) != sums_[size_t(b)])
    ZS_THROW(corrupted, "checkpoint: " << path_ << ": block " << b << " (" << len
                                       << " bytes at file offset "
                                       << kHeaderBytes + b * h_.block_bytes
                                       << ") fails its checksum: the file is damaged");
}

void DataFileReader::fetch_block(int64_t b, char* into) const {
  ZS_CHECK(b >= 0 && b < blocks() && reinterpret_cast<uintptr_t>(into) % kAlign == 0);
  const int64_t len = block_len(b), at = kHeaderBytes + b * h_.block_bytes;
  // O_DIRECT moves whole 4 KiB sectors: a last block of another length goes through the cache.
  pread_all(direct_fd_ && len % int64_t(kAlign) == 0 ? direct_fd_.get() : fd_.get(), into,
            size_t(len), at, path_, "data");
  verify(b, into);
}

int64_t DataFileReader::block_len(int64_t b) const {
  return std::min(h_.block_bytes, h_.data_bytes - b * h_.block_bytes);
}

// Reads block b into `into` and verifies it. The disk works on the next blocks meanwhile
// (readahead started by the kernel, no copy): a few reads in flight, as the disk needs to reach
// its bandwidth.
void DataFileReader::read_block(int64_t b, char* into) {
  constexpr int64_t kAhead = 8;
  ahead_ = std::max(ahead_, b + 1);
  for (; ahead_ < std::min(blocks(), b + 1 + kAhead); ++ahead_)
    ::posix_fadvise(fd_.get(), off_t(kHeaderBytes + ahead_ * h_.block_bytes),
                    off_t(block_len(ahead_)), POSIX_FADV_WILLNEED);
  const int64_t len = block_len(b), at = kHeaderBytes + b * h_.block_bytes;
  read_at(into, size_t(len), at, "data");
  verify(b, into);
}

const char* DataFileReader::load_block(int64_t b) {
  if (cached_ != b) {
    cached_ = -1;
    read_block(b, block_.data());
    cached_ = b;
  }
  return block_.data();
}

// A block wholly inside the range is read straight into `out` and verified there (one copy
// fewer); the ends of the range go through block_. On a checksum mismatch `out` may then hold
// part of the damaged block.
void DataFileReader::read(int64_t at, int64_t bytes, char* out) {
  int64_t byte = at;
  const int64_t end = at + bytes;
  ZS_CHECK(at >= 0 && bytes >= 0 && end <= h_.data_bytes);
  while (byte < end) {
    const int64_t b = byte / h_.block_bytes, in = byte - b * h_.block_bytes;
    const int64_t take = std::min(end - byte, block_len(b) - in);
    if (in == 0 && take == block_len(b) && cached_ != b)
      read_block(b, out);
    else
      std::memcpy(out, load_block(b) + in, size_t(take));
    out += take, byte += take;
  }
}

UnitReader::UnitReader(std::filesystem::path dir, const Manifest& m) : dir_(std::move(dir)), m_(m) {
  by_unit_.resize(m.units.size());
  for (size_t r = 0; r < m.ranges.size(); ++r)
    for (size_t i = 0; i < m.ranges[r].size(); ++i)
      by_unit_[size_t(m.ranges[r][i].unit)].emplace_back(int(r), i);
  at_.resize(state_names().size());
  for (size_t s = 0; s < at_.size(); ++s)
    for (int r = 0; r < int(m.ranges.size()); ++r) at_[s].push_back(range_bytes(m, r, int(s)));
}

void UnitReader::read(int s, int u, int64_t b, int64_t e, float* out) {
  const Encoding enc = encoding_of(m_, s);
  std::vector<Piece> list;
  pieces(s, u, b, e, list);
  for (const Piece& p : list) {
    if (enc.format == StateFormat::f32) {
      file(p.rank, s).read(p.at, p.bytes, reinterpret_cast<char*>(out + p.to));
    } else {
      encoded_.resize(size_t(p.bytes));
      file(p.rank, s).read(p.at, p.bytes, encoded_.data());
      decode(enc, p.n, p.lo, p.hi, encoded_.data(), out + p.to);
    }
  }
  close_after(s, u);
}

void UnitReader::read_stored(int s, int u, int64_t b, int64_t e, void* data, float* absmax) {
  const Encoding enc = encoding_of(m_, s);
  const int64_t size = enc.format == StateFormat::q8 ? 1 : encoded_bytes(enc, 1);
  std::vector<Piece> list;
  pieces(s, u, b, e, list);
  for (const Piece& p : list) {
    encoded_.resize(size_t(p.bytes));
    file(p.rank, s).read(p.at, p.bytes, encoded_.data());
    if (enc.format == StateFormat::q8) ZS_CHECK(p.to % enc.block == 0);
    unpack(enc, p.n, p.lo, p.hi, encoded_.data(), static_cast<char*>(data) + p.to * size,
           absmax ? absmax + p.to / enc.block : nullptr);
  }
  close_after(s, u);
}

// Readers go through the units in order: a file whose last range was unit u's is done (a load
// from many ranks' files would otherwise hold all of them open at once).
void UnitReader::close_after(int s, int u) {
  for (const auto& [r, i] : by_unit_[size_t(u)])
    if (u == m_.ranges[size_t(r)].back().unit) files_.erase({r, s});
}

void UnitReader::pieces(int s, int u, int64_t b, int64_t e, std::vector<Piece>& out) const {
  const Encoding enc = encoding_of(m_, s);
  for (const auto& [r, i] : by_unit_[size_t(u)]) {
    const Range& rg = m_.ranges[size_t(r)][i];
    const int64_t lo = std::max(b, rg.begin), hi = std::min(e, rg.end);
    if (lo >= hi) continue;
    const int64_t n = rg.end - rg.begin;
    const ByteSpan span = span_of(enc, n, lo - rg.begin, hi - rg.begin);
    out.push_back({r, at_[size_t(s)][size_t(r)][i] + span.first, span.last - span.first, lo - b, n,
                   lo - rg.begin, hi - rg.begin});
  }
}

DataFileReader& UnitReader::file(int r, int s) {
  std::unique_ptr<DataFileReader>& f = files_[{r, s}];
  if (!f)
    f = std::make_unique<DataFileReader>(dir_ / data_file_name(r, state_names()[size_t(s)].name),
                                         expected_header(m_, r, s));
  return *f;
}

}  // namespace zeroshard::ckpt
