#pragma once
// The caching allocator (src/compute/caching_allocator.hpp: the bookkeeping, tested on the CPU)
// over CUDA: cudaMalloc or cudaHostAlloc (portable) for the memory, timing-free CUDA events for a
// freed block's last use on its stream. Internal header, built only with ZEROSHARD_WITH_CUDA.

#include <memory>

#include "src/compute/caching_allocator.hpp"

namespace zeroshard::cuda {

using CachingAllocator = ::zeroshard::CachingAllocator;

/// A caching allocator of device memory of `device`, or of page-locked host memory (usable with
/// every device; `device` is made current while it allocates and for its events).
std::shared_ptr<CachingAllocator> make_caching_allocator(CachingAllocator::Kind kind, int device);

}  // namespace zeroshard::cuda
