// The CUDA kernels' launch arithmetic (kernels/cuda/launch_math.hpp), run on the CPU with the
// sizes that break 32-bit arithmetic: every element is covered exactly once by the grid-stride
// loops and by an update run's head, body and tail; body vectors are aligned; indices past 2^31
// and 2^32 come out exact.

#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

#include "kernels/cuda/launch_math.hpp"

namespace zeroshard::cuda::launch {
namespace {

constexpr int64_t k2p31 = int64_t(1) << 31;
constexpr int64_t k2p32 = int64_t(1) << 32;

// Sizes around the 32-bit limits, and small ones of every tail length.
std::vector<int64_t> big_sizes() {
  return {k2p31 - 1,     k2p31, k2p31 + 1, k2p31 + 7,
          k2p32 - 1,     k2p32, k2p32 + 9, (int64_t(1) << 40) + 3,
          17 * k2p32 + 5};
}

TEST(LaunchMath, VectorsAreExactPast32Bits) {
  for (int64_t n : big_sizes()) {
    EXPECT_EQ(vectors(n), n / kVec + (n % kVec != 0)) << n;
    EXPECT_GE(vectors(n) * kVec, n);
    EXPECT_LT(vectors(n) * kVec - n, kVec);
  }
  EXPECT_EQ(vectors(0), 0);
  EXPECT_EQ(vectors(1), 1);
}

TEST(LaunchMath, GridIsClampedAndAtLeastOne) {
  EXPECT_EQ(grid_for(0, kMaxGrid), 1u);
  EXPECT_EQ(grid_for(1, kMaxGrid), 1u);
  EXPECT_EQ(grid_for(kThreads, kMaxGrid), 1u);
  EXPECT_EQ(grid_for(kThreads + 1, kMaxGrid), 2u);
  for (int64_t n : big_sizes()) EXPECT_EQ(grid_for(vectors(n), kMaxGrid), unsigned(kMaxGrid)) << n;
}

// Every vector of n elements is visited exactly once by the grid-stride loop of the kernels.
void expect_grid_stride_covers(int64_t n, int64_t cap) {
  const int64_t vecs = vectors(n);
  const unsigned grid = grid_for(vecs, cap);
  const int64_t stride = grid_stride(grid);
  std::vector<uint8_t> seen(size_t(vecs), 0);
  for (unsigned b = 0; b < grid; ++b)
    for (unsigned t = 0; t < unsigned(kThreads); ++t)
      for (int64_t v = first_vector(b, t); v < vecs; v += stride) ++seen[size_t(v)];
  for (int64_t v = 0; v < vecs; ++v) ASSERT_EQ(seen[size_t(v)], 1) << "n " << n << " vector " << v;
}

TEST(LaunchMath, GridStrideCoversEveryVectorOnce) {
  for (int64_t n : {1, 7, 8, 9, 2047, 2048, 2049, 1 << 20, (1 << 22) + 3})
    expect_grid_stride_covers(n, kMaxGrid);
  // A small cap makes every thread loop several times, as past 2^31 elements.
  for (int64_t n : {100000, 1 << 20}) expect_grid_stride_covers(n, 3);
}

TEST(LaunchMath, GridStrideIndicesPast32Bits) {
  // The last block's last thread starts below the end and its steps stay exact past 2^32.
  for (int64_t n : big_sizes()) {
    const int64_t vecs = vectors(n);
    const unsigned grid = grid_for(vecs, kMaxGrid);
    const int64_t stride = grid_stride(grid);
    EXPECT_EQ(stride, int64_t(kMaxGrid) * kThreads);
    const int64_t last_first = first_vector(grid - 1, kThreads - 1);
    EXPECT_EQ(last_first, stride - 1);
    // The thread that owns the last vector reaches it in whole steps from its first vector.
    const int64_t owner = (vecs - 1) % stride;
    EXPECT_EQ(owner + (vecs - 1) / stride * stride, vecs - 1) << n;
    EXPECT_GE((vecs - 1) * kVec, n - kVec) << n;
  }
}

// Elements [begin, end) covered by a run's head, its blocks' body vectors and its tail, each
// counted; offsets are relative to `base`, so runs far past 2^32 are checked in a small array.
void expect_run_covered(int64_t base, int64_t begin, int64_t end) {
  const RunSplit s = split_run(base + begin, base + end);
  ASSERT_LE(s.body_begin, s.body_end);
  if (s.body_begin < s.body_end) {  // vectors start on multiples of kVec (an empty body anywhere)
    ASSERT_EQ(s.body_begin % kVec, 0);
    ASSERT_EQ(s.body_end % kVec, 0);
  }
  ASSERT_LT(s.body_begin - (base + begin), kVec);
  ASSERT_LT(base + end - s.body_end, kVec);
  std::vector<uint8_t> seen(size_t(end - begin), 0);
  const auto hit = [&](int64_t e) {
    ASSERT_GE(e, base + begin);
    ASSERT_LT(e, base + end);
    ++seen[size_t(e - base - begin)];
  };
  const int64_t blocks = run_blocks(s);
  ASSERT_GE(blocks, 1);
  for (int64_t b = 0; b < blocks; ++b)
    for (unsigned t = 0; t < unsigned(kThreads); ++t) {
      const int64_t i = body_element(s, unsigned(b), t);
      if (i < s.body_end)
        for (int k = 0; k < kVec; ++k) hit(i + k);
    }
  for (int t = 0; t < 2 * kVec; ++t) {
    const int64_t e = head_tail_element(base + begin, s, t);
    if (e < head_tail_stop(base + end, s, t)) hit(e);
  }
  for (size_t i = 0; i < seen.size(); ++i)
    ASSERT_EQ(seen[i], 1) << "run [" << begin << ", " << end << ") at base " << base << ": element "
                          << i;
}

TEST(LaunchMath, UpdateRunsCoverEveryElementOnce) {
  for (int64_t base : {int64_t(0), k2p31 - 5, k2p31, k2p32 + 3, (int64_t(1) << 40) + 1}) {
    for (int64_t begin = 0; begin < 2 * kVec; ++begin)
      for (int64_t len : {0, 1, 6, 7, 8, 9, 15, 16, 17, 2047, 2048, 2049, 70001})
        expect_run_covered(base, begin, begin + len);
  }
}

TEST(LaunchMath, RunBlocksPast32Bits) {
  // A run of 2^34 elements needs 2^23 blocks; one of 2^44 needs 2^33, which no launch takes:
  // the launcher refuses what exceeds kMaxBlocks instead of truncating to unsigned.
  const RunSplit a = split_run(3, (int64_t(1) << 34) + 3);
  EXPECT_EQ(run_blocks(a), (((int64_t(1) << 34) - 8) / kVec + kThreads - 1) / kThreads);
  const RunSplit b = split_run(0, int64_t(1) << 44);
  EXPECT_GT(run_blocks(b), kMaxBlocks);
  // The last body vector of a 2^33-element run is addressed exactly by its last block.
  const RunSplit c = split_run(0, int64_t(1) << 33);
  const int64_t last_block = run_blocks(c) - 1;
  EXPECT_EQ(body_element(c, unsigned(last_block), kThreads - 1), (int64_t(1) << 33) - kVec);
}

}  // namespace
}  // namespace zeroshard::cuda::launch
