#pragma once
/// \file calibration.hpp
/// Measurements of this machine that benchmarks compare against and the planner is calibrated
/// with.

#include <cstdint>
#include <memory>
#include <vector>

#include "zeroshard/communicator.hpp"
#include "zeroshard/config.hpp"
#include "zeroshard/export.hpp"
#include "zeroshard/types.hpp"

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

/// The collectives of one size, as `zeroshard calibrate` measures them (and plan_step_bench beside
/// its steps): reduce-scatter, all-gather and all-reduce (a sum) of `bytes` per rank of `dtype`
/// (a reduce-scatter's output block, an all-gather's input block, an all-reduce's buffer), in
/// seconds per call, each the slowest rank's median of `reps` calls after one untimed, every
/// call between barriers:
/// - warm: on one buffer used again and again (in the caches up to their size, as the engine's
///   reused staging slots are);
/// - cold: on a fresh buffer each call from a ring of 256 MiB (as the engine's whole gradient
///   and parameter buffers, one per unit);
/// - queued (reduce-scatter and all-gather): up to 16 calls on the ring's buffers started at
///   once and waited for together, per call (as stages 0-1 reduce every unit's gradients and
///   stages 1-2 gather every unit's parameters).
/// Collective: every rank of `comm` calls it with the same arguments.
struct CollectiveTimes {
  double warm[3], cold[3];  ///< reduce-scatter, all-gather, all-reduce
  double queued[2];         ///< reduce-scatter, all-gather
};
ZS_API CollectiveTimes time_collectives(Communicator& comm, int64_t bytes, DType dtype, int reps);

/// Pinned host memory copied to and from GPU `device` (−1: the launcher's local rank modulo the
/// GPUs) as a GPU engine copies it (its device backend's copies, to and from memory its pinned
/// allocator gave): `bytes` per copy, each direction's median of `reps` copies after one
/// untimed, in GB/s. What MachineRates::h2d_gbs and d2h_gbs hold. Throws Error(invalid_config)
/// in a build without CUDA, Error(cuda_error) where no GPU can be used.
struct PcieRates {
  double h2d_gbs = 0, d2h_gbs = 0;
};
ZS_API PcieRates time_pcie(int device, int64_t bytes, int reps);

/// The fused optimizer update alone, as an engine configured as `cfg` issues it with its state
/// in the memory of Config::device (a GPU's, or the CPU's arena): one update of `n` parameters
/// (rounded up to whole Config::state_block blocks) in cfg's dtype, moments' format and master,
/// every array in that memory, timed to its end (the device synchronized); the median of `reps`
/// after one untimed, in seconds. What MachineRates::gpu_update_params_per_s is n / of. Throws
/// Error(invalid_config) for a configuration the engine refuses or a GPU this build or machine
/// does not have.
ZS_API double time_update(const Config& cfg, int64_t n, int reps);

/// Muon's Newton–Schulz iteration alone (f32, `steps` steps), as an engine's owner rank runs it
/// on the CPU on a rows × cols matrix: the median of `reps` after one untimed, in seconds. Its
/// multiply-adds (the iteration's cost that owners are balanced by) are written to `madds`.
/// MachineRates::newton_schulz holds such points.
ZS_API double time_newton_schulz(int64_t rows, int64_t cols, int steps, int reps, double* madds);

}  // namespace zeroshard
