#pragma once
// Resources one engine owns (docs/DESIGN.md rule 4), in the order they must outlive each other: the
// CPU arena, the device's and the CPU's compute backends (a GPU backend owns its streams), the
// ledger every buffer reports to, the nvme tier's run directories and ring, and the pools of
// staging buffers the stage logic cycles. No globals: each engine has its own.

#include <memory>
#include <vector>

#include "base/buffer_pool.hpp"
#include "base/ledger.hpp"
#include "kernels/cpu/arena.hpp"
#include "offload/swap_space.hpp"
#include "src/compute/compute.hpp"

namespace zeroshard {

struct Config;

struct Resources {
  /// The backends Config::device names (see make_compute()), or `dev` for the device where
  /// given (a plan's stand-in, whose memory is counted and never allocated).
  explicit Resources(const Config& cfg, std::unique_ptr<Compute> dev = nullptr);
  ~Resources();

  cpu::Arena arena;
  // Buffers return their memory to the backends' allocators and unregister from the ledger when
  // they die: both are declared before anything that holds a Buffer.
  std::unique_ptr<Compute> dev, host;
  Ledger ledger;
  std::unique_ptr<offload::SwapSpace> swap;  // the nvme tier's; null without one
  BufferPool grad_staging;  // stages 2–3: the trainer's whole gradient until it is reduced
  BufferPool gather;        // stage 3: gathered units (in use or prefetched)
};

}  // namespace zeroshard
