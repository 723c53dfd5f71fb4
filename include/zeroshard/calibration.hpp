#pragma once
/// \file calibration.hpp
/// Measurements of this machine that benchmarks compare against and the planner is calibrated
/// with.

#include <cstdint>
#include <memory>
#include <vector>

#include "zeroshard/export.hpp"

namespace zeroshard {

/// One stream of a same-bytes pass: n elements of `element_bytes` each (a multiple of 2) at
/// `data`, in host memory.
struct MemoryStream {
  void* data = nullptr;
  int element_bytes = 4;
};

/// The memory ceiling of a CPU pass over given streams: every read stream read and every write
/// stream written once, with no arithmetic, split and scheduled as the engine's CPU update is
/// (64 Ki-element chunks on a oneTBB arena, the kernel ISA the engine picks). An optimizer step
/// moving the same streams cannot beat it by more than the noise; the planner's memory
/// bandwidth comes from it.
class ZS_API SameBytesPass {
 public:
  /// threads <= 0: the engine's default (ZEROSHARD_CPU_THREADS, else cores / local ranks).
  explicit SameBytesPass(int threads = 0);
  ~SameBytesPass();
  SameBytesPass(const SameBytesPass&) = delete;
  SameBytesPass& operator=(const SameBytesPass&) = delete;

  int threads() const;
  const char* isa() const;  ///< "scalar", "avx2" or "avx512"

  /// One pass over n elements of every stream; returns its wall time in seconds. Chunk [b, e)
  /// moves elements [b, e) of every stream, so all advance together as in the update (w-byte
  /// elements as 4-byte words, a stream's last odd half-word left out). Write streams are
  /// overwritten with meaningless bits; the same pointer in both lists is an in-place stream.
  /// At most 8 read and 8 write streams of each element width, and at least one write stream
  /// of every width read. Throws Error (invalid_argument) on bad streams.
  double run(const std::vector<MemoryStream>& reads, const std::vector<MemoryStream>& writes,
             int64_t n);

 private:
  struct ZS_HIDDEN Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace zeroshard
