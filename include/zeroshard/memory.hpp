#pragma once
/// \file memory.hpp
/// The ledger's report: every byte the engine holds, by tier × kind, with peaks.

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "zeroshard/export.hpp"
#include "zeroshard/types.hpp"

namespace zeroshard {

/// What a block of memory holds.
/// - param: low-precision parameters (whole in stages 0–2, this rank's shard in stage 3)
/// - grad: the gradients the engine keeps between micro-steps and the step (whole in stages
///   0–1, this rank's shard in stages 2–3)
/// - master: f32 master weights (an f32 model's master aliases its parameters and counts once)
/// - optim_state: optimizer moments (Adam: m and v; SGD with momentum, Lion: one buffer)
/// - buffer: working buffers (gather, gradient staging, reduction output, accumulation, swap
///   staging), each also listed by name in MemoryReport::buffers
enum class MemKind : uint8_t { param, grad, master, optim_state, buffer };
inline constexpr int kNumMemKinds = 5;
inline constexpr int kNumTiers = 3;
ZS_API const char* mem_kind_name(MemKind k);

struct NamedBuffer {
  std::string name;  ///< e.g. "grad_staging", "gather", "grad_shard", "grad_accum"
  Tier tier;
  int64_t bytes;  ///< currently held
  int64_t peak;   ///< most held at once since the engine was created
};

struct ZS_API MemoryReport {
  /// bytes[tier][kind] currently held and the peak of each cell, in bytes, on this rank.
  std::array<std::array<int64_t, kNumMemKinds>, kNumTiers> bytes{};
  std::array<std::array<int64_t, kNumMemKinds>, kNumTiers> peak{};
  std::vector<NamedBuffer> buffers;

  int64_t at(Tier t, MemKind k) const { return bytes[int(t)][int(k)]; }
  int64_t total(Tier t) const;
  int64_t total() const;
  /// Bytes of param + grad + master + optim_state over all tiers (the ZeRO "model states").
  int64_t model_state_bytes() const;
  /// A fixed-width table: one row per kind, one column per tier, then the named buffers.
  std::string to_string() const;
};

}  // namespace zeroshard
