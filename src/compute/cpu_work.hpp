#pragma once
// The element-wise work of the CPU backends, once: the synchronous CPU backend (compute.cpp)
// calls these where it is asked, the asynchronous CPU device (async_cpu_device.cpp) when its
// stream reaches them. Same calls, same chunks, so both are bitwise equal.

#include <cstdint>
#include <vector>

#include "kernels/cpu/arena.hpp"
#include "kernels/cpu/newton_schulz.hpp"
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
/// Muon's kernels (Compute::muon_average(), with `wide` grown as needed, and
/// Compute::newton_schulz()), in the calling thread.
void muon_average(cpu::Arena& arena, const cpu::UpdateArgs& a, const cpu::UpdateHyper& h,
                  int64_t lo, int64_t hi, float* d, std::vector<float>& wide);
void newton_schulz(float* x, int64_t rows, int64_t cols, const cpu::NsOptions& o, float* scratch);
/// Σ float(x)² in double, fixed chunks summed in index order.
double sum_squares(cpu::Arena& arena, const GradSpan& x);

}  // namespace zeroshard::cpu_work
