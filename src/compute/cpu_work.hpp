#pragma once
// The element-wise work of the CPU backends, once: the synchronous CPU backend (compute.cpp)
// calls these where it is asked, the asynchronous CPU device (async_cpu_device.cpp) when its
// stream reaches them. Same calls, same chunks, so both are bitwise equal.

#include <cstdint>
#include <vector>

#include "kernels/cpu/arena.hpp"
#include "kernels/cpu/update_tasks.hpp"
#include "src/compute/stream_device.hpp"

namespace zeroshard::cpu_work {

/// dst[i] = convert(src[i]) over the arena (a no-op for the same buffer and dtype).
void convert(cpu::Arena& arena, const void* src, DType sd, void* dst, DType dd, int64_t n);
/// acc[i] += float(g[i]) over the arena.
void accumulate(cpu::Arena& arena, float* acc, const void* g, DType gd, int64_t n);
/// The fused update of `units`, cut into the arena's tasks.
void update(cpu::Arena& arena, const std::vector<cpu::UpdateHyper>& hyper,
            const std::vector<cpu::UnitUpdate>& units);
/// Σ float(x)² in double, fixed chunks summed in index order.
double sum_squares(cpu::Arena& arena, const GradSpan& x);

}  // namespace zeroshard::cpu_work
