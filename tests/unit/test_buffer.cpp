// Buffer: zero-filled memory counted in the ledger. Large buffers are mapped zero pages that take
// memory only when written, so an engine's finalize() grows as it fills its state unit by unit
// and a trainer's own copy of the model never peaks together with the engine's untouched
// buffers (the moments and gradients, first written by a step).
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstddef>
#include <vector>

#include "base/ledger.hpp"

using namespace zeroshard;

namespace {

size_t resident_pages(const void* p, size_t bytes) {
  const size_t page = size_t(sysconf(_SC_PAGESIZE));
  std::vector<unsigned char> v((bytes + page - 1) / page);
  EXPECT_EQ(mincore(const_cast<void*>(p), bytes, v.data()), 0);
  return size_t(std::count_if(v.begin(), v.end(), [](unsigned char c) { return c & 1; }));
}

TEST(Buffer, LargeBuffersTakeMemoryOnlyWhereWritten) {
  Ledger ledger;
  const size_t bytes = size_t(8) << 20;
  Buffer b(&ledger, Tier::device, MemKind::optim_state, "state0", bytes);
  EXPECT_EQ(ledger.report().at(Tier::device, MemKind::optim_state), int64_t(bytes))
      << "the ledger counts the whole buffer from the start";
  EXPECT_EQ(resident_pages(b.data(), bytes), 0u) << "allocating touched the pages";
  // Where transparent huge pages are "always", one write would fault in 2 MiB: count in 4 KiB.
  ASSERT_EQ(madvise(b.data(), bytes, MADV_NOHUGEPAGE), 0);
  b.as<unsigned char>()[bytes / 2] = 1;
  EXPECT_EQ(resident_pages(b.data(), bytes), 1u) << "writing a byte took more than its page";
  const auto* c = b.as<unsigned char>();
  EXPECT_EQ(std::count(c, c + bytes, 0), std::ptrdiff_t(bytes) - 1) << "not zero-filled";
}

// populate() faults a fresh buffer in before a copy into it (a save's snapshot): one kernel call
// instead of a page trap per 4 KiB. The pages are resident afterwards and still read as zeros.
TEST(Buffer, PopulateFaultsEveryPageIn) {
#ifndef MADV_POPULATE_WRITE
  GTEST_SKIP() << "built against a kernel without MADV_POPULATE_WRITE";
#else
  Ledger ledger;
  const size_t bytes = size_t(8) << 20;
  Buffer b(&ledger, Tier::host, MemKind::buffer, "checkpoint_snapshot", bytes);
  ASSERT_EQ(madvise(b.data(), bytes, MADV_NOHUGEPAGE), 0);
  ASSERT_EQ(resident_pages(b.data(), bytes), 0u);
  {
    // The kernel's own answer: a kernel before 5.14 refuses the advice, and populate() leaves
    // the buffer as it is.
    Buffer probe(&ledger, Tier::host, MemKind::buffer, "probe", size_t(1) << 20);
    if (madvise(probe.data(), size_t(1) << 20, MADV_POPULATE_WRITE) != 0)
      GTEST_SKIP() << "this kernel refuses MADV_POPULATE_WRITE";
  }
  const size_t page = size_t(sysconf(_SC_PAGESIZE));
  // A range (as finalize()'s thread faults a snapshot in, a chunk at a time): its pages only,
  // from the page it starts in.
  b.populate(3 * page + 5, 2 * page);
  EXPECT_EQ(resident_pages(b.data(), bytes), 3u);
  b.populate(bytes - page, 100 * page);  // clamped to the buffer
  EXPECT_EQ(resident_pages(b.data(), bytes), 4u);
  b.populate();
  EXPECT_EQ(resident_pages(b.data(), bytes), bytes / page);
  const auto* c = b.as<unsigned char>();
  EXPECT_EQ(std::count(c, c + bytes, 0), std::ptrdiff_t(bytes));
#endif
}

TEST(Buffer, SmallAndStagingBuffersAreZeroedAndCounted) {
  Ledger ledger;
  {
    Buffer small(&ledger, Tier::host, MemKind::buffer, "small", 1000);
    Buffer staging(&ledger, Tier::host, MemKind::buffer, "staging", size_t(4) << 20, false, true);
    for (const Buffer* b : {&small, &staging}) {
      const auto* c = b->as<unsigned char>();
      EXPECT_TRUE(std::all_of(c, c + b->bytes(), [](unsigned char x) { return x == 0; }));
    }
    EXPECT_EQ(ledger.report().at(Tier::host, MemKind::buffer), int64_t(1000 + (size_t(4) << 20)));
  }
  EXPECT_EQ(ledger.report().at(Tier::host, MemKind::buffer), 0)
      << "a freed buffer is still counted";
}

}  // namespace
