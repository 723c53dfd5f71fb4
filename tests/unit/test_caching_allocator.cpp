// The caching allocator's bookkeeping (src/compute/caching_allocator.cpp) on a backend of host
// memory whose events the test completes by hand: size classes, reuse on the same stream at
// once and on another only after the last use is done, waits before freeing, the retry after an
// out-of-memory answer, and the bytes it reports. The CUDA backend of the same bookkeeping is
// tests/gpu/test_gpu_runtime.cpp.

#include <gtest/gtest.h>

#include <cstdlib>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "src/compute/caching_allocator.hpp"
#include "zeroshard/error.hpp"

namespace zeroshard {
namespace {

// What the fake device saw, shared with the test after the allocator took its backend.
struct Device {
  std::set<void*> live;       // allocated and not freed
  std::vector<bool*> events;  // each event's "done" flag, owned here
  std::vector<void*> waited;  // events waited for
  int allocs = 0, frees = 0;
  int refuse_next = 0;             // the next this many allocs answer "out of memory"
  size_t limit = size_t(1) << 40;  // bytes it holds at most
  size_t held = 0;
  std::vector<std::pair<void*, size_t>> sizes;
};

class FakeBlocks final : public CachingAllocator::Backend {
 public:
  explicit FakeBlocks(Device& d) : d_(d) {}
  void* alloc(size_t bytes) override {
    if (d_.refuse_next > 0) {
      --d_.refuse_next;
      return nullptr;
    }
    if (d_.held + bytes > d_.limit) return nullptr;
    void* p = std::aligned_alloc(256, bytes);
    d_.live.insert(p);
    d_.sizes.push_back({p, bytes});
    d_.held += bytes;
    ++d_.allocs;
    return p;
  }
  void free(void* p) noexcept override {
    for (auto& [q, n] : d_.sizes)
      if (q == p) d_.held -= n;
    d_.live.erase(p);
    ++d_.frees;
    std::free(p);
  }
  void* new_event() noexcept override {
    d_.events.push_back(new bool(false));
    return d_.events.back();
  }
  void delete_event(void*) noexcept override {}  // the Device owns them
  bool record(void* e, void*) noexcept override {
    *static_cast<bool*>(e) = false;  // the stream's work so far: not done until the test says
    return true;
  }
  bool done(void* e) override { return *static_cast<bool*>(e); }
  void wait(void* e) noexcept override {
    d_.waited.push_back(e);
    *static_cast<bool*>(e) = true;
  }

 private:
  Device& d_;
};

struct Fixture {
  Device dev;
  std::shared_ptr<CachingAllocator> alloc = CachingAllocator::create(
      CachingAllocator::Kind::device, 0, std::make_unique<FakeBlocks>(dev));
  ~Fixture() {
    alloc.reset();
    for (bool* b : dev.events) delete b;
  }
  void complete_all() {
    for (bool* b : dev.events) *b = true;
  }
};

void* const kStreamA = reinterpret_cast<void*>(0x10);
void* const kStreamB = reinterpret_cast<void*>(0x20);

TEST(CachingAllocator, ClassSizes) {
  EXPECT_EQ(CachingAllocator::class_size(1), 512u);
  EXPECT_EQ(CachingAllocator::class_size(513), 1024u);
  EXPECT_EQ(CachingAllocator::class_size(size_t{1} << 20), size_t{1} << 20);
  EXPECT_EQ(CachingAllocator::class_size((size_t{1} << 20) + 1), size_t{2} << 20);
  EXPECT_EQ(CachingAllocator::class_size((size_t{3} << 20) + 1), size_t{4} << 20);
}

TEST(CachingAllocator, ReusesOnTheSameStreamAtOnceAndElsewhereOnlyOnceDone) {
  Fixture f;
  void* first = nullptr;
  {
    auto b = f.alloc->allocate(4000, kStreamA);
    first = b.data();
    EXPECT_EQ(b.bytes(), 4096u);
    EXPECT_EQ(f.alloc->stats().in_use_bytes, 4096u);
  }  // freed with its last use still queued on A
  EXPECT_EQ(f.alloc->stats().in_use_bytes, 0u);
  EXPECT_EQ(f.alloc->stats().reserved_bytes, 4096u);
  {
    auto c = f.alloc->allocate(4096, kStreamB);  // A's work not done: a new block
    EXPECT_NE(c.data(), first) << "handed a block still in use on another stream";
    auto d = f.alloc->allocate(4096, kStreamA);  // the same stream reuses it at once
    EXPECT_EQ(d.data(), first);
  }
  f.complete_all();
  auto e = f.alloc->allocate(4096, kStreamB);  // done now: any stream may have a cached one
  EXPECT_EQ(f.dev.allocs, 2);
  const CachingAllocator::Stats st = f.alloc->stats();
  EXPECT_EQ(st.backend_allocations, 2u);
  EXPECT_EQ(st.cache_hits, 2u);
  EXPECT_EQ(st.peak_in_use_bytes, 2 * 4096u);
  EXPECT_EQ(st.reserved_bytes, 2 * 4096u);
}

TEST(CachingAllocator, ReleaseWaitsForTheLastUseBeforeFreeing) {
  Fixture f;
  { auto b = f.alloc->allocate(1 << 12, kStreamA); }
  ASSERT_EQ(f.dev.live.size(), 1u);
  f.alloc->release_cached();
  EXPECT_EQ(f.dev.waited.size(), 1u) << "freed a block without waiting for its stream";
  EXPECT_TRUE(f.dev.live.empty());
  EXPECT_EQ(f.alloc->stats().reserved_bytes, 0u);
}

TEST(CachingAllocator, OutOfMemoryEmptiesTheCacheThenRetriesThenSaysNoSpace) {
  Fixture f;
  f.dev.limit = (size_t{5} << 20) / 2;  // room for one 2 MiB block and a little
  { auto b = f.alloc->allocate(size_t{2} << 20, kStreamA); }  // cached, its use not done
  // A 1 MiB request does not fit next to the cached block: the cache is given back (after
  // waiting for the block's last use) and the request retried.
  auto c = f.alloc->allocate(size_t{1} << 20, kStreamB);
  EXPECT_EQ(f.dev.frees, 1);
  EXPECT_EQ(f.dev.waited.size(), 1u);
  EXPECT_EQ(f.alloc->stats().reserved_bytes, size_t{1} << 20);
  // More than the device holds: no_space, naming the bytes.
  try {
    f.alloc->allocate(size_t{4} << 20, kStreamA);
    FAIL() << "allocated more than the device holds";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::no_space);
    EXPECT_NE(std::string(e.what()).find("cannot allocate 4194304 bytes"), std::string::npos)
        << e.what();
  }
}

TEST(CachingAllocator, ReserveAddsCachedCapacity) {
  Fixture f;
  f.alloc->reserve(size_t{5} << 20, 2);
  EXPECT_EQ(f.alloc->stats().reserved_bytes, 2 * (size_t{6} << 20));
  EXPECT_EQ(f.alloc->stats().in_use_bytes, 0u);
  {
    auto x = f.alloc->allocate(size_t{5} << 20);
    auto y = f.alloc->allocate(size_t{5} << 20);
    EXPECT_EQ(f.dev.allocs, 2) << "reserved blocks were not reused";
  }
  EXPECT_NE(f.alloc->report().find("2 device allocations"), std::string::npos) << f.alloc->report();
}

}  // namespace
}  // namespace zeroshard
