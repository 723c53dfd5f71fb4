// The CUDA RAII layer and the caching allocator: moves transfer ownership, errors carry the
// expression and CUDA's words, the allocator reuses blocks (no cudaMalloc once warm), reports
// its bytes, and never hands a block to another stream before its last use completed.

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "src/cuda/caching_allocator.hpp"
#include "src/cuda/cuda_resources.hpp"
#include "tests/gpu/gpu_test_util.hpp"
#include "zeroshard/error.hpp"

namespace zeroshard::cuda {
namespace {

class GpuRuntime : public ::testing::Test {
 protected:
  void SetUp() override { ZS_REQUIRE_GPU(); }
};

TEST_F(GpuRuntime, CheckMacroNamesExpressionAndCudaError) {
  try {
    ZS_CUDA_CHECK(cudaSetDevice(1 << 20));
    FAIL() << "cudaSetDevice of a device that does not exist succeeded";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::cuda_error);
    const std::string msg = e.what();
    EXPECT_NE(msg.find("cudaSetDevice(1 << 20)"), std::string::npos) << msg;
    EXPECT_NE(msg.find("cudaErrorInvalidDevice"), std::string::npos) << msg;
    EXPECT_NE(msg.find("test_gpu_runtime.cpp"), std::string::npos) << msg;
  }
}

TEST_F(GpuRuntime, OwnersMoveAndRelease) {
  Stream a(0);
  ASSERT_NE(a.get(), nullptr);
  const cudaStream_t raw = a.get();
  Stream b(std::move(a));
  EXPECT_EQ(a.get(), nullptr);
  EXPECT_EQ(b.get(), raw);
  DeviceBuffer buf(0, 1 << 20);
  DeviceBuffer moved = std::move(buf);
  EXPECT_EQ(buf.data(), nullptr);
  EXPECT_EQ(moved.bytes(), size_t{1} << 20);
  int dev = -1;
  EXPECT_TRUE(is_device_pointer(moved.data(), &dev));
  EXPECT_EQ(dev, 0);
  PinnedBuffer pinned(4096);
  EXPECT_FALSE(is_device_pointer(pinned.data()));
  int on_stack = 0;
  EXPECT_FALSE(is_device_pointer(&on_stack));
  // A timed event pair around a copy measures something.
  Event start(true), stop(true);
  start.record(b.get());
  ZS_CUDA_CHECK(
      cudaMemcpyAsync(moved.data(), pinned.data(), 4096, cudaMemcpyHostToDevice, b.get()));
  stop.record(b.get());
  stop.synchronize();
  EXPECT_TRUE(stop.query());
  EXPECT_GE(stop.elapsed_ms_since(start), 0.0f);
}

TEST_F(GpuRuntime, DeviceGuardRestoresTheCallersDevice) {
  ZS_CUDA_CHECK(cudaSetDevice(0));
  { DeviceGuard guard(0); }
  int now = -1;
  ZS_CUDA_CHECK(cudaGetDevice(&now));
  EXPECT_EQ(now, 0);
}

TEST_F(GpuRuntime, AllocatorReusesBlocksAndReportsBytes) {
  auto alloc = make_caching_allocator(CachingAllocator::Kind::device, 0);
  Stream s(0);
  void* first = nullptr;
  {
    auto b = alloc->allocate(1000, s.get());
    first = b.data();
    EXPECT_EQ(b.bytes(), 1024u);
    EXPECT_EQ(alloc->stats().in_use_bytes, 1024u);
  }
  EXPECT_EQ(alloc->stats().in_use_bytes, 0u);
  EXPECT_EQ(alloc->stats().reserved_bytes, 1024u);
  // Warm: the same class on the same stream comes from the cache, with no new cudaMalloc.
  for (int i = 0; i < 100; ++i) {
    auto b = alloc->allocate(700, s.get());
    EXPECT_EQ(b.data(), first);
  }
  auto st = alloc->stats();
  EXPECT_EQ(st.backend_allocations, 1u);
  EXPECT_EQ(st.cache_hits, 100u);
  EXPECT_EQ(st.peak_in_use_bytes, 1024u);
  // Large classes are multiples of 2 MiB; reserve() adds cached capacity up front.
  EXPECT_EQ(CachingAllocator::class_size((size_t{3} << 20) + 1), size_t{4} << 20);
  alloc->reserve(size_t{5} << 20, 2);
  st = alloc->stats();
  EXPECT_EQ(st.reserved_bytes, 1024u + 2 * (size_t{6} << 20));
  EXPECT_EQ(st.in_use_bytes, 0u);
  {
    auto x = alloc->allocate(size_t{5} << 20, s.get());
    auto y = alloc->allocate(size_t{5} << 20, s.get());
    EXPECT_EQ(alloc->stats().backend_allocations, 3u) << "reserved blocks were not reused";
  }
  EXPECT_NE(alloc->report().find("reserved"), std::string::npos);
  alloc->release_cached();
  EXPECT_EQ(alloc->stats().reserved_bytes, 0u);
}

// A block freed while its stream is still busy goes to another stream only after that work.
TEST_F(GpuRuntime, AllocatorOrdersReuseAcrossStreams) {
  auto alloc = make_caching_allocator(CachingAllocator::Kind::device, 0);
  Stream busy(0), other(0);
  std::atomic<bool> release{false};
  // Hold `busy` with a host function until the test lets it go.
  ZS_CUDA_CHECK(cudaLaunchHostFunc(
      busy.get(),
      [](void* flag) {
        while (!static_cast<std::atomic<bool>*>(flag)->load())
          std::this_thread::sleep_for(std::chrono::milliseconds(1));
      },
      &release));
  void* first = nullptr;
  {
    auto b = alloc->allocate(4096, busy.get());
    first = b.data();
  }
  {
    auto c = alloc->allocate(4096, other.get());
    EXPECT_NE(c.data(), first) << "handed a block still in use on another stream";
    auto d = alloc->allocate(4096, busy.get());
    EXPECT_EQ(d.data(), first) << "the same stream may reuse at once";
  }
  release.store(true);
  busy.synchronize();
  auto e = alloc->allocate(4096, other.get());
  (void)e;
  EXPECT_EQ(alloc->stats().backend_allocations, 2u);
}

TEST_F(GpuRuntime, PinnedAllocator) {
  auto alloc = make_caching_allocator(CachingAllocator::Kind::pinned_host, 0);
  auto b = alloc->allocate(100);
  EXPECT_FALSE(is_device_pointer(b.data()));
  static_cast<char*>(b.data())[99] = 7;  // host-writable
  EXPECT_EQ(alloc->stats().in_use_bytes, 512u);
}

}  // namespace
}  // namespace zeroshard::cuda
