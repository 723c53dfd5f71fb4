#pragma once
// A checkpoint data file (format.hpp): written once, front to back, through a block buffer that
// checksums each block as it fills; read back block by block, each block verified before any of
// its bytes is used.
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <filesystem>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "base/unique_fd.hpp"
#include "src/checkpoint/format.hpp"

namespace zeroshard::ckpt {

/// `bytes` of memory for whole blocks of a data file, 2 MiB-aligned and backed by transparent
/// huge pages where the kernel allows (as the swapper's staging): an O_DIRECT transfer of a
/// 4 MiB block is then a few physically contiguous segments, not 1024 pages that the block layer
/// splits into several requests (at fio's settings, huge pages move 1.7x the bytes of 4 KiB ones
/// on this project's disk: benchmarks/RESULTS.md).
struct BlockBuffer {
  explicit BlockBuffer(size_t bytes);
  ~BlockBuffer();
  BlockBuffer(const BlockBuffer&) = delete;
  BlockBuffer& operator=(const BlockBuffer&) = delete;
  char* data;
};

/// Writes through O_DIRECT where the file system allows it (the page cache would halve the
/// disk's write bandwidth on a virtual disk), from aligned block buffers that writer threads
/// checksum and write, several at a time, while the caller fills the next one.
class DataFileWriter {
 public:
  /// Creates `path` (which must not exist) for h.data_bytes of data.
  DataFileWriter(std::filesystem::path path, const FileHeader& h);
  ~DataFileWriter();
  DataFileWriter(const DataFileWriter&) = delete;
  DataFileWriter& operator=(const DataFileWriter&) = delete;
  /// The next bytes of data.
  void append(const void* data, size_t bytes);
  /// Writes the last block, the checksum table and the header, and fsyncs. Throws unless
  /// exactly h.data_bytes were appended.
  void finish();

 private:
  struct Block;
  void hand_over();  // the block being filled to the writer thread
  void run();        // a writer thread
  void stop();       // ends the writer threads once the queue is empty
  void write_at(const void* data, size_t bytes, int64_t offset, bool direct);
  void rethrow();  // the writer thread's error, if any

  std::filesystem::path path_;
  FileHeader h_;
  UniqueFd fd_, direct_fd_;  // direct_fd_: O_DIRECT, or none where the file system refuses it
  std::vector<std::unique_ptr<Block>> free_, queued_;
  std::unique_ptr<Block> filling_;
  int64_t blocks_ = 0;   // handed over so far
  int64_t written_ = 0;  // data bytes appended so far
  std::vector<uint64_t> sums_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;
  std::exception_ptr error_;
  static constexpr size_t kWriters = 4;  // blocks in flight to the disk, per file
  std::vector<std::thread> threads_;
};

/// Reads a data file block by block, each block verified before any of its bytes is used:
/// through the page cache, with the next blocks on their way from the disk (the kernel's
/// readahead, asked for explicitly) while the caller checks the current one, for a reader that
/// goes front to back (read(), verify_all()); or a block at a time from many threads
/// (fetch_block(), for block_read.hpp).
class DataFileReader {
 public:
  /// Opens `path` and checks its header against what the manifest expects of it, its size, and
  /// its checksum table's own checksum. Throws Error(corrupted) naming the file.
  DataFileReader(std::filesystem::path path, const FileHeader& expected);
  /// Data bytes [at, at + bytes) into out, every block they touch verified (on failure, out may
  /// hold part of the damaged block).
  void read(int64_t at, int64_t bytes, char* out);
  /// Verifies every block; `done(bytes)` after each.
  template <class F>
  void verify_all(F&& done) {
    for (int64_t b = 0; b < blocks(); ++b) {
      load_block(b);
      done(block_len(b));
    }
  }
  int64_t blocks() const { return int64_t(sums_.size()); }
  /// Bytes of data in block b (block_bytes but for the last).
  int64_t block_len(int64_t b) const;
  /// Block b into `into` (4096-aligned memory), verified. Safe to call from
  /// many threads at once: it keeps no cache and asks for no readahead, for callers that keep
  /// many reads in flight themselves. O_DIRECT where the file system allows it.
  void fetch_block(int64_t b, char* into) const;

 private:
  const char* load_block(int64_t b);  // block b in block_, verified
  void read_block(int64_t b, char* into);
  void verify(int64_t b, const char* data) const;
  void read_at(void* data, size_t bytes, int64_t offset, const char* what) const;

  std::filesystem::path path_;
  FileHeader h_;
  UniqueFd fd_;
  UniqueFd direct_fd_;  // O_DIRECT, or none where the file system refuses it
  std::vector<uint64_t> sums_;
  std::vector<char> block_;
  int64_t cached_ = -1;  // index of the block in block_
  int64_t ahead_ = 0;    // blocks before this one were asked of the disk ahead of their read
};

/// Unit values out of a checkpoint's files, whichever ranks wrote them: one DataFileReader per
/// file, opened (and its header and table checked) on first use and closed after its last
/// range, so that reading units in order holds few files open.
class UnitReader {
 public:
  UnitReader(std::filesystem::path dir, const Manifest& m);
  /// Values [b, e) of unit u's state s (an index into state_names()) into out as f32, every
  /// block verified.
  void read(int s, int u, int64_t b, int64_t e, float* out);
  /// The same without a conversion, into storage of the checkpoint's own format for state s
  /// (encoding.hpp's unpack()): `data` receives value b first, `absmax` (q8) the absmax of the
  /// block starting at b first; b on a block boundary.
  void read_stored(int s, int u, int64_t b, int64_t e, void* data, float* absmax);
  /// Where read(s, u, b, e, out) takes its values from: data bytes [at, at + bytes) of rank
  /// `rank`'s file of state s hold values [lo, hi) of a range of n values, which go to
  /// out + to. For an f32 state the bytes are exactly those values'; else encoding.hpp's span.
  struct Piece {
    int rank;
    int64_t at, bytes, to;
    int64_t n, lo, hi;
  };
  void pieces(int s, int u, int64_t b, int64_t e, std::vector<Piece>& out) const;

 private:
  DataFileReader& file(int r, int s);
  void close_after(int s, int u);  // the files of state s whose last range unit u's was

  std::filesystem::path dir_;
  const Manifest& m_;
  std::vector<std::vector<std::pair<int, size_t>>> by_unit_;  // (rank, index of its range)
  std::vector<std::vector<std::vector<int64_t>>> at_;         // [state][rank][range]: byte
  std::map<std::pair<int, int>, std::unique_ptr<DataFileReader>> files_;
  std::vector<char> encoded_;  // a piece of a state that is not f32
};

}  // namespace zeroshard::ckpt
