// A load's passes over a checkpoint (block_read.hpp).
#include "src/checkpoint/block_read.hpp"

#include <atomic>
#include <cstring>
#include <map>
#include <memory>
#include <tuple>

#include "base/check.hpp"
#include "base/in_threads.hpp"
#include "src/checkpoint/data_file.hpp"
#include "src/checkpoint/encoding.hpp"

namespace zeroshard::ckpt {

namespace {

constexpr uintptr_t kPage = 4096;  // O_DIRECT's alignment of memory and lengths
constexpr size_t kReaders = 8;     // block reads in flight, as the disk needs for its bandwidth

// Bytes [in, in + bytes) of a block go to `to`.
struct Segment {
  int64_t in, bytes;
  char* to;
};

// One block of one file, and where its bytes go.
struct Job {
  const DataFileReader* file = nullptr;
  int64_t block = 0;
  std::vector<Segment> segments;
  // The whole block lands in one place that O_DIRECT can write to.
  bool direct() const {
    const Segment& s = segments.front();
    return segments.size() == 1 && s.in == 0 && s.bytes == file->block_len(block) &&
           reinterpret_cast<uintptr_t>(s.to) % kPage == 0;
  }
};

// Writes the first byte of every page of [p, p + bytes) that begins inside it, and the first
// byte itself: the pages are faulted in by the CPU before a read lands there. On this project's
// virtual machine a fresh page faulted in by an O_DIRECT read costs more than one the CPU
// touched first (benchmarks/RESULTS.md, "Checkpoint save and load against fio").
void touch(char* p, int64_t bytes) {
  if (bytes <= 0) return;
  volatile char* v = p;
  v[0] = 0;
  const uintptr_t first = (reinterpret_cast<uintptr_t>(p) + kPage - 1) & ~(kPage - 1);
  for (uintptr_t a = first; a < reinterpret_cast<uintptr_t>(p) + uintptr_t(bytes); a += kPage)
    *reinterpret_cast<volatile char*>(a) = 0;
}

// The data files a load reads, by (state, rank).
using Files = std::map<std::pair<int, int>, std::unique_ptr<DataFileReader>>;

// Calls f(target, piece, file) for every piece of every target, each file opened (header and
// checksum table checked) once, in `files`.
template <class F>
void for_each_piece(const std::filesystem::path& dir, const Manifest& m,
                    const std::vector<ReadTarget>& targets, Files& files, F&& f) {
  const UnitReader where(dir, m);
  std::vector<UnitReader::Piece> pieces;
  for (const ReadTarget& t : targets) {
    pieces.clear();
    where.pieces(t.s, t.u, t.b, t.e, pieces);
    for (const UnitReader::Piece& p : pieces) {
      std::unique_ptr<DataFileReader>& file = files[{t.s, p.rank}];
      if (!file)
        file = std::make_unique<DataFileReader>(
            dir / data_file_name(p.rank, state_names()[size_t(t.s)].name),
            expected_header(m, p.rank, t.s));
      f(t, p, *file);
    }
  }
}

}  // namespace

void check_files(const std::filesystem::path& dir, const Manifest& m,
                 const std::vector<ReadTarget>& targets) {
  Files files;
  for_each_piece(dir, m, targets, files, [](auto&&...) {});
}

void read_blocks(const std::filesystem::path& dir, const Manifest& m,
                 const std::vector<ReadTarget>& targets) {
  for (const ReadTarget& t : targets) {
    ZS_CHECK(t.out);
    // Values land as they lie in the file: only an f32 state can be read in place.
    ZS_CHECK(encoding_of(m, t.s).format == StateFormat::f32);
  }
  // Every block to read, in file order.
  Files files;
  std::map<std::tuple<int, int, int64_t>, Job> by_block;  // (state, rank, block)
  for_each_piece(dir, m, targets, files,
                 [&](const ReadTarget& t, const UnitReader::Piece& p, const DataFileReader& f) {
                   char* to = reinterpret_cast<char*>(t.out + p.to);
                   for (int64_t byte = p.at, end = p.at + p.bytes; byte < end;) {
                     const int64_t b = byte / m.block_bytes, in = byte - b * m.block_bytes;
                     const int64_t take = std::min(end - byte, f.block_len(b) - in);
                     Job& job = by_block[{t.s, p.rank, b}];
                     job.file = &f;
                     job.block = b;
                     job.segments.push_back({in, take, to});
                     byte += take;
                     to += take;
                   }
                 });
  std::vector<Job> jobs;
  jobs.reserve(by_block.size());
  for (auto& [key, job] : by_block) jobs.push_back(std::move(job));

  // Readers take the blocks in order; one more thread runs ahead of them touching where the
  // blocks go. A reader's error stops the others at their next block.
  std::atomic<size_t> next{0}, touched{0};
  std::atomic<bool> failed{false};
  in_threads(kReaders + 1, [&](size_t t) {
    if (t == kReaders) {
      for (size_t k = 0; k < jobs.size() && !failed.load(std::memory_order_relaxed); ++k) {
        for (const Segment& s : jobs[k].segments) touch(s.to, s.bytes);
        touched.store(k + 1, std::memory_order_release);
        touched.notify_all();
      }
      touched.store(jobs.size(), std::memory_order_release);
      touched.notify_all();
      return;
    }
    try {
      std::unique_ptr<BlockBuffer> bounce;  // for blocks that do not land whole
      for (size_t k; !failed.load(std::memory_order_relaxed) && (k = next++) < jobs.size();) {
        for (size_t seen; (seen = touched.load(std::memory_order_acquire)) <= k;)
          touched.wait(seen, std::memory_order_acquire);
        if (failed.load(std::memory_order_relaxed)) break;
        const Job& job = jobs[k];
        if (job.direct()) {
          job.file->fetch_block(job.block, job.segments.front().to);
          continue;
        }
        if (!bounce) bounce = std::make_unique<BlockBuffer>(size_t(m.block_bytes));
        job.file->fetch_block(job.block, bounce->data);
        for (const Segment& s : job.segments)
          std::memcpy(s.to, bounce->data + s.in, size_t(s.bytes));
      }
    } catch (...) {
      failed = true;
      throw;
    }
  });
}

}  // namespace zeroshard::ckpt
