#pragma once
// The CUDA kernels' launch arithmetic: grid sizes, the vector each thread starts at, grid-stride
// steps, and how an update run splits into a scalar head, a body of aligned 8-element vectors
// and a scalar tail. Plain C++ (constexpr, and __host__ __device__ under nvcc), so that the
// kernels and their launchers compute with these functions and the CPU tests
// (tests/unit/test_launch_math.cpp) call the same ones with the sizes that break 32-bit
// arithmetic (2^31 elements and past), tails of every length and misaligned run ends.
//
// Every index is an int64_t element or vector index; block and thread indices are unsigned as
// CUDA gives them and are widened before any product. No std:: call: device code uses these.

#include <cstdint>

#ifdef __CUDACC__
#define ZS_LAUNCH_FN __host__ __device__ constexpr
#else
#define ZS_LAUNCH_FN constexpr
#endif

namespace zeroshard::cuda::launch {

inline constexpr int kThreads = 256;  ///< threads per block of every element-wise kernel
inline constexpr int kVec = 8;        ///< elements per vector access (16 B of bf16, 32 B of f32)
/// Element-wise grids stop growing here (grid-stride loops do the rest): enough blocks to fill
/// any current GPU several times over.
inline constexpr int64_t kMaxGrid = 8192;
/// The most blocks one launch may have (gridDim.x is at most 2^31 − 1).
inline constexpr int64_t kMaxBlocks = 0x7FFFFFFF;

/// Vectors of kVec elements covering n elements (the last one partial).
ZS_LAUNCH_FN int64_t vectors(int64_t n) {
  return (n + kVec - 1) / kVec;
}

/// Blocks for `vecs` vectors at kThreads each, at least one, at most `cap`.
ZS_LAUNCH_FN unsigned grid_for(int64_t vecs, int64_t cap) {
  const int64_t b = (vecs + kThreads - 1) / kThreads;
  return unsigned(b < 1 ? 1 : b > cap ? cap : b);
}

/// A grid-stride loop's first vector for thread `thread` of block `block`, and its step.
ZS_LAUNCH_FN int64_t first_vector(unsigned block, unsigned thread) {
  return int64_t(block) * kThreads + int64_t(thread);
}
ZS_LAUNCH_FN int64_t grid_stride(unsigned grid) {
  return int64_t(grid) * kThreads;
}

/// An update run [begin, end) split for vector accesses: elements [begin, body_begin) and
/// [body_end, end) (at most kVec − 1 each) are updated one by one by the run's first block;
/// [body_begin, body_end) is whole vectors, whose element offsets are multiples of kVec (so a
/// 16-byte aligned base pointer makes every vector access aligned).
struct RunSplit {
  int64_t body_begin = 0;
  int64_t body_end = 0;
};
ZS_LAUNCH_FN RunSplit split_run(int64_t begin, int64_t end) {
  const int64_t up = (begin + kVec - 1) / kVec * kVec, down = end / kVec * kVec;
  const int64_t body_begin = up < end ? up : end;
  return {body_begin, down > body_begin ? down : body_begin};
}

/// Blocks a run takes: one thread per body vector, and at least one block (its first block
/// also does the head and the tail).
ZS_LAUNCH_FN int64_t run_blocks(const RunSplit& s) {
  const int64_t blocks = ((s.body_end - s.body_begin) / kVec + kThreads - 1) / kThreads;
  return blocks < 1 ? 1 : blocks;
}

/// The first element of the vector thread `thread` of the run's `block_in_run`-th block
/// updates (it updates it only if below body_end).
ZS_LAUNCH_FN int64_t body_element(const RunSplit& s, unsigned block_in_run, unsigned thread) {
  return s.body_begin + (int64_t(block_in_run) * kThreads + int64_t(thread)) * kVec;
}

/// The head or tail element thread t < 2 kVec of a run's first block updates: threads 0..7
/// take begin + t, threads 8..15 take body_end + t − 8; valid only if below head_tail_stop().
ZS_LAUNCH_FN int64_t head_tail_element(int64_t begin, const RunSplit& s, int t) {
  return t < kVec ? begin + t : s.body_end + (t - kVec);
}
ZS_LAUNCH_FN int64_t head_tail_stop(int64_t end, const RunSplit& s, int t) {
  return t < kVec ? s.body_begin : end;
}

}  // namespace zeroshard::cuda::launch

#undef ZS_LAUNCH_FN
