// The swapper below the engine: striped swap files, the I/O queue and its result checking,
// checksums, and the per-run directory. Faults come in through the I/O seam (FaultBackend) or
// are done to the files for real; each test fails if the code under it ignores the fault.
#include <fcntl.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <condition_variable>
#include <cstring>
#include <deque>
#include <filesystem>
#include <fstream>
#include <memory>
#include <mutex>

#include "base/checksum.hpp"
#include "offload/io_queue.hpp"
#include "offload/pinned_pool.hpp"
#include "offload/run_dir.hpp"
#include "offload/swap_store.hpp"
#include "tests/fault/fault_backend.hpp"
#include "tests/multirank/harness.hpp"
#include "zeroshard/error.hpp"

using namespace zeroshard;
using namespace zeroshard::offload;
using ::testing::HasSubstr;
namespace fs = std::filesystem;

namespace {

fs::path scratch_root(const std::string& name) {
  fs::path p =
      fs::temp_directory_path() / ("zeroshard-swapper-" + std::to_string(::getpid())) / name;
  fs::create_directories(p);
  return p;
}

// One store over two paths, 4 KiB stripes (or `block`), two extents of 10.5 × 4 KiB, and a pool
// of two buffers: [0] written from, [1] read into.
struct Rig {
  Ledger ledger;
  fs::path base;
  std::vector<RunDir> dirs;
  SwapStore store;
  PinnedPool pool;
  std::unique_ptr<IoQueue> io;
  std::shared_ptr<zs_fault::FaultPlan> plan = std::make_shared<zs_fault::FaultPlan>();
  int ext[2];
  static constexpr size_t kBytes = 43008;  // 10.5 × 4 KiB

  explicit Rig(const std::string& name, int queue_depth = 4, int64_t block = 4096)
      : base(scratch_root(name)) {
    fs::create_directories(base / "p0");
    fs::create_directories(base / "p1");
    dirs.emplace_back(base / "p0", 0);
    dirs.emplace_back(base / "p1", 0);
    store = SwapStore("test state", "test.swap", {&dirs[0], &dirs[1]}, block);
    ext[0] = store.add_extent(kBytes);
    ext[1] = store.add_extent(kBytes);
    store.open(true);
    pool = PinnedPool(&ledger, "test_staging", 2, kBytes, true);
    BackendSetup setup;
    setup.fds = store.fds();
    pool.append_iovecs(setup.buffers);
    setup.queue_depth = queue_depth;
    io = std::make_unique<IoQueue>(
        std::make_unique<zs_fault::FaultBackend>(make_uring_backend(setup), plan),
        store.file_names());
  }
  ~Rig() {
    io.reset();
    std::error_code ec;
    fs::remove_all(base, ec);
    fs::remove(base.parent_path(), ec);  // the process's directory, once its last rig is gone
  }
  char* out() { return pool.data(0); }
  char* in() { return pool.data(1); }
  void fill(uint32_t seed) {
    for (size_t i = 0; i < kBytes; ++i) out()[i] = char((i * 131 + seed * 7) >> 3);
    std::memset(in(), 0, kBytes);
  }
  std::shared_ptr<IoBatch> transfer(int e, bool write) {
    std::vector<Piece> ps;
    store.pieces(ext[e], write ? out() : in(), &pool, write, ps);
    return io->submit(std::move(ps), std::string("test ") + (write ? "write" : "read"));
  }
  void write(int e) { io->wait(*transfer(e, true)); }
  void read(int e) { io->wait(*transfer(e, false)); }
  bool round_trip_ok() { return std::memcmp(out(), in(), kBytes) == 0; }
};

// A backend that moves no data: it records the offsets in the order requests reach it and
// completes each in full, none until the test opens its gate. One request at a time.
class GatedBackend final : public IoBackend {
 public:
  int depth() const override { return 1; }
  void submit(const IoOp* ops, int n) override {
    std::lock_guard<std::mutex> lock(mu_);
    for (int i = 0; i < n; ++i) {
      order.push_back(ops[i].offset);
      pending_.push_back({ops[i].tag, int(ops[i].len)});
    }
    cv_.notify_all();
  }
  int reap(IoCompletion* out, int max, int min) override {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return min == 0 || (open_ && int(pending_.size()) >= min); });
    int got = 0;
    while (open_ && got < max && !pending_.empty()) {
      out[got++] = pending_.front();
      pending_.pop_front();
    }
    return got;
  }
  void open() {
    std::lock_guard<std::mutex> lock(mu_);
    open_ = true;
    cv_.notify_all();
  }
  /// Waits until `n` requests have reached the backend.
  void wait_for(size_t n) {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return order.size() >= n; });
  }
  std::vector<uint64_t> order;  // read once the queue is done with it

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool open_ = false;
  std::deque<IoCompletion> pending_;
};

// A background batch (the speculative step's I/O) gives way: a batch submitted while its first
// piece is in flight goes before its other pieces, so backward's gradient writes never wait
// behind work that is only ahead of time. Batches of one kind keep their order.
TEST(Swapper, BackgroundBatchesGiveWayToLaterOnes) {
  auto owned = std::make_unique<GatedBackend>();
  GatedBackend* backend = owned.get();
  IoQueue io(std::move(owned), {"test file"});
  alignas(4096) static char buf[4096];
  auto pieces = [&](uint64_t first, int n) {
    std::vector<Piece> ps;
    for (int i = 0; i < n; ++i) {
      Piece p;
      p.offset = (first + uint64_t(i)) * 4096;
      p.len = 4096;
      p.write = true;
      p.buf = buf;
      ps.push_back(p);
    }
    return ps;
  };
  auto background = io.submit(pieces(0, 4), "background", true);
  backend->wait_for(1);  // its first piece is in flight
  auto first = io.submit(pieces(100, 2), "first");
  auto second = io.submit(pieces(200, 1), "second");
  auto later = io.submit(pieces(300, 1), "later background", true);
  backend->open();
  io.wait(*background);
  io.wait(*first);
  io.wait(*second);
  io.wait(*later);
  const std::vector<uint64_t> want = {0, 100, 101, 200, 1, 2, 3, 300};
  std::vector<uint64_t> got;
  for (uint64_t o : backend->order) got.push_back(o / 4096);
  EXPECT_EQ(got, want);
}

TEST(Swapper, Xxh64MatchesReferenceVectors) {
  EXPECT_EQ(xxh64("", 0, 0), 0xEF46DB3751D8E999ull);
  EXPECT_EQ(xxh64("a", 1, 0), 0xD24EC4F1A98C6E5Bull);
  EXPECT_EQ(xxh64("abc", 3, 0), 0x44BC2CF5AD770999ull);
  // Different seeds (block offsets) give different sums for the same bytes.
  EXPECT_NE(xxh64("abc", 3, 0), xxh64("abc", 3, 4096));
}

TEST(Swapper, StripesOverEveryPathAndRoundTrips) {
  Rig r("stripes");
  r.fill(1);
  r.write(0);
  r.fill(2);
  r.write(1);
  r.read(1);
  EXPECT_TRUE(r.round_trip_ok());
  // 4 KiB stripes alternate between the two files: both hold data, neither holds it all.
  for (const auto& p : r.store.paths()) EXPECT_GE(fs::file_size(p), 2 * Rig::kBytes / 2);
  std::vector<Piece> ps;
  r.store.pieces(r.ext[0], r.out(), &r.pool, false, ps);
  ASSERT_EQ(ps.size(), 11u);
  EXPECT_NE(ps[0].file, ps[1].file);
  // Files are private to the user; the directory is too.
  struct stat st {};
  ASSERT_EQ(::stat(r.store.paths()[0].c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  ASSERT_EQ(::stat(r.dirs[0].path().c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0700u);
}

// The kernel really moves fewer bytes than asked: the queue sends the rest again.
TEST(Swapper, ShortTransfersAreResubmittedForTheRemainder) {
  Rig r("short", 4, 16384);
  r.plan->short_aligned = true;
  r.plan->armed = true;
  r.fill(3);
  r.write(0);
  r.read(0);
  EXPECT_TRUE(r.round_trip_ok());
  EXPECT_GT(r.plan->injected.load(), 0);
  EXPECT_GT(r.io->counters().resubmitted, 0);
}

// A short count that breaks O_DIRECT alignment: the remainder goes through the buffered fd.
TEST(Swapper, MisalignedRemainderGoesThroughTheBufferedDescriptor) {
  Rig r("misaligned", 4, 16384);
  r.plan->short_misaligned = true;
  r.plan->armed = true;
  r.fill(4);
  r.write(0);
  r.read(0);
  EXPECT_TRUE(r.round_trip_ok());
  EXPECT_GT(r.plan->injected.load(), 0);
}

TEST(Swapper, EagainAndEintrAreRetried) {
  Rig r("transient", 2);
  r.plan->transient_every = 3;
  r.plan->armed = true;
  r.fill(5);
  r.write(0);
  r.read(0);
  EXPECT_TRUE(r.round_trip_ok());
  EXPECT_GE(r.plan->injected.load(), 4);
  EXPECT_GE(r.io->counters().resubmitted, 4);
}

TEST(Swapper, EioFailsTheBatchNamingFileOffsetAndErrno) {
  Rig r("eio");
  r.plan->fail_write_at = 5;
  r.plan->armed = true;
  r.fill(6);
  try {
    r.write(0);
    ADD_FAILURE() << "the injected EIO was ignored";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::io_error);
    EXPECT_THAT(std::string(e.what()), HasSubstr("test write: write of 4096 bytes at offset"));
    EXPECT_THAT(std::string(e.what()), HasSubstr("test.swap failed: Input/output error (EIO)"));
  }
  // The queue is still usable after a failed batch.
  r.plan->armed = false;
  r.write(0);
  r.read(0);
  EXPECT_TRUE(r.round_trip_ok());
}

TEST(Swapper, EnospcIsNoSpace) {
  Rig r("enospc");
  r.plan->fail_write_at = 0;
  r.plan->error = ENOSPC;
  r.plan->armed = true;
  r.fill(7);
  EXPECT_ZS_ERROR(r.write(1), no_space, "No space left on device (ENOSPC)");
}

TEST(Swapper, ChecksumCatchesABitFlippedInFlight) {
  Rig r("flip");
  r.fill(8);
  r.write(0);
  r.plan->flip_read_at = 7;
  r.plan->armed = true;
  EXPECT_ZS_ERROR(r.read(0), corrupted, "checksum mismatch");
}

// The file is changed behind the queue's back with ordinary writes: the next read notices.
TEST(Swapper, CorruptedAndTruncatedFilesAreDetected) {
  Rig r("behind");
  r.fill(9);
  r.write(0);
  r.write(1);
  {
    const std::string f = r.store.paths()[1].string();
    int fd = ::open(f.c_str(), O_RDWR);
    ASSERT_GE(fd, 0);
    char b = 0;
    ASSERT_EQ(::pread(fd, &b, 1, 4096 + 17), 1);
    b ^= 1;
    ASSERT_EQ(::pwrite(fd, &b, 1, 4096 + 17), 1);
    ::close(fd);
  }
  EXPECT_ZS_ERROR(r.read(0), corrupted, "checksum mismatch");
  fs::resize_file(r.store.paths()[0], 8192);
  EXPECT_ZS_ERROR(r.read(1), corrupted, "truncated");
}

// ---- the per-run directory ---------------------------------------------------------------------

TEST(RunDirTest, StaleDirectoryIsReportedRemovedAndNeverReused) {
  const fs::path root = scratch_root("stale");
  // A crashed run: complete lock file, nobody holds it.
  const fs::path dead = root / "zeroshard-999999-0-rank3";
  fs::create_directories(dead);
  std::ofstream(dead / "lock") << "pid 999999 on elsewhere, rank 3, started 0\n";
  std::ofstream(dead / "optim.swap") << "stale data";
  // A live run: its lock is held (by this test, through its own descriptor).
  const fs::path live = root / "zeroshard-999998-0-rank0";
  fs::create_directories(live);
  std::ofstream(live / "lock") << "pid 999998 on here, rank 0, started 0\n";
  int fd = ::open((live / "lock").c_str(), O_RDWR);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(::flock(fd, LOCK_EX | LOCK_NB), 0);
  // A directory being created right now (no lock file yet): left alone.
  const fs::path young = root / "zeroshard-999997-0-rank1";
  fs::create_directories(young);
  // Not ours at all.
  fs::create_directories(root / "other-data");

  ::testing::internal::CaptureStderr();
  {
    RunDir d(root, 0);
    EXPECT_TRUE(fs::exists(d.path()));
    EXPECT_NE(d.path(), dead);
  }
  const std::string err = ::testing::internal::GetCapturedStderr();
  EXPECT_THAT(err, HasSubstr("removing swap directory " + dead.string()));
  EXPECT_THAT(err, HasSubstr("pid 999999 on elsewhere"));
  EXPECT_FALSE(fs::exists(dead));
  EXPECT_TRUE(fs::exists(live / "lock"));
  EXPECT_TRUE(fs::exists(young));
  EXPECT_TRUE(fs::exists(root / "other-data"));
  // Once the live run's lock is released (its process died), it is stale too.
  ::close(fd);
  ::testing::internal::CaptureStderr();
  EXPECT_EQ(RunDir::clean_stale(root, 0), 1);
  ::testing::internal::GetCapturedStderr();
  EXPECT_FALSE(fs::exists(live));
  std::error_code ec;
  fs::remove_all(root.parent_path(), ec);
}

TEST(RunDirTest, MissingOrNonDirectoryPathFailsNamingIt) {
  EXPECT_ZS_ERROR(
      RunDir("/nonexistent/zeroshard", 2), io_error,
      "rank 2: nvme path '/nonexistent/zeroshard' cannot be used: No such file or directory");
  const fs::path root = scratch_root("file");
  std::ofstream(root / "plain") << "x";
  EXPECT_ZS_ERROR(RunDir(root / "plain", 0), io_error, "is not a directory");
  std::error_code ec;
  fs::remove_all(root.parent_path(), ec);
}

}  // namespace
