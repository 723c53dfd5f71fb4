#pragma once
// Internal interface of the CUDA kernels (not installed). Plain C++: no CUDA type appears here,
// a stream is passed as an opaque handle (a cudaStream_t cast to void*; nullptr is the legacy
// default stream), so engine code compiled by the host compiler can call every launcher.
//
// Every launcher only enqueues work on `stream` and returns; pointers are device pointers (or
// managed memory) of the current device. A launch error throws Error(cuda_error) naming the
// kernel; errors of the kernel's execution surface at the next synchronisation of the stream.
//
// Exactness contract: optimizer_update, convert and accumulate are bitwise equal to the CPU
// kernels (cpu_kernels.hpp, any Isa) for every input whose results are not NaN. They run the
// same IEEE single-precision operations in the same order per element (each one spelled with a
// __f*_rn intrinsic, and the file is built with --fmad=false, so no multiply-add contraction),
// honour subnormals (no flush to zero), and round every narrowing conversion to nearest even.
// A NaN result is a NaN on both, but the GPU writes the canonical NaN where the CPU keeps the
// payload; with 8-bit moments, a block whose new absmax is inf (an inf moment) turns x / absmax
// into NaN, whose sign (positive on the GPU, negative on x86) picks the code: such blocks may
// differ. sum_squares_nonfinite sums in double in another order than the CPU (threads, blocks):
// its error relative to the exact sum stays below 1e-12 up to 2^31 elements (squares of floats
// are exact in double; each thread chains at most n / 2^18 + 30 additions), and for a given n
// the result is the same bits on every run.

#include <cstddef>
#include <cstdint>

#include "kernels/cpu/cpu_kernels.hpp"
#include "kernels/cpu/newton_schulz.hpp"
#include "zeroshard/types.hpp"

namespace zeroshard::cuda {

/// A cudaStream_t, opaque to host-compiler code. nullptr = the legacy default stream.
using StreamHandle = void*;

/// Elements [begin, end) of a unit's state (the element indices of UpdateArgs' arrays) that
/// belong to one parameter group, updated with hypers[hyper]. Mirrors the engine's GroupRun.
struct UpdateRun {
  int64_t begin = 0;
  int64_t end = 0;
  int hyper = 0;
};

/// The fused optimizer update of one unit on the GPU: for every element of every run, the same
/// update cpu::optimizer_update(isa, hypers[run.hyper], ...) applies (formulas and operation
/// order in cpu_kernels.hpp; grad_scale = unscale × clip is applied to the gradient first;
/// the optional low-precision copy `out` is written in the same pass). Elements outside every
/// run are neither read nor written, so padding and other groups' ranges stay as they are.
///
/// `a` describes the whole unit: a.n elements; master/state0/state1/out index like master, grad
/// likewise (a.grad_dtype f32, bf16 or f16). Every non-null pointer must be 16-byte aligned
/// (cudaMalloc and the caching allocator give 256 bytes): the kernel moves 8 elements per
/// 16-byte or 32-byte access, with per-element code only for the ≤7 elements at each end of a run.
/// Runs must not overlap and must lie in [0, a.n); all their hypers must need the same state
/// arrays (one optimizer kind). One kernel launch per unit for up to kMaxRunsPerLaunch runs of
/// one update rule (more runs, or SGD groups with and without momentum, take a few launches).
/// Throws Error(invalid_argument) for a bad argument, Error(cuda_error) if the launch fails.
inline constexpr int kMaxRunsPerLaunch = 32;
void optimizer_update(const cpu::UpdateHyper* hypers, int num_hypers, const UpdateRun* runs,
                      int num_runs, const cpu::UpdateArgs& a, StreamHandle stream);

/// Device workspace sum_squares_nonfinite needs (per-block partials); callers keep one per
/// stream, since concurrent calls on different streams must not share it.
inline constexpr size_t kSumSquaresWorkspaceBytes = 16384;

/// One pass over x (n elements of dtype): out[0] = Σ float(x[i])² accumulated in double and
/// out[1] = 1.0 if any x[i] is inf or NaN, else 0.0 — the [sum of squares, overflow flag] pair
/// the engine all-reduces. With accumulate, out[0] += the sum and out[1] stays 1.0 once set
/// (so units can be summed in a fixed order). `out` is two device doubles; `workspace` holds
/// kSumSquaresWorkspaceBytes device bytes. Each thread sums its elements in index order, then
/// blocks combine in a fixed tree and the partials in a fixed order: the result depends only on
/// the values and n, never on timing. x may have any alignment.
void sum_squares_nonfinite(const void* x, DType dtype, int64_t n, double* out, bool accumulate,
                           void* workspace, StreamHandle stream);

/// dst[i] = convert(src[i]) for any pair of dtypes (same dtype: a device-to-device copy, NaN
/// payloads kept). Any alignment (16-byte aligned pointers take the vector path).
void convert(const void* src, DType src_dtype, void* dst, DType dst_dtype, int64_t n,
             StreamHandle stream);

/// acc[i] += float(g[i]) in f32 (micro-step gradient accumulation). Any alignment.
void accumulate(float* acc, const void* g, DType g_dtype, int64_t n, StreamHandle stream);

/// Muon's direction over elements [lo, hi) of the update `a` describes, into d[0, hi − lo):
/// cpu::muon_average, bitwise (f32, bf16 or 8-bit momentum). Device memory.
void muon_average(const cpu::UpdateArgs& a, const cpu::UpdateHyper& h, int64_t lo, int64_t hi,
                  float* d, StreamHandle stream);

/// A cuBLAS handle (cublasHandle_t, opaque) of the current device for newton_schulz(), with
/// plain f32 products (no TF32); destroy_blas() frees it.
void* create_blas();
void destroy_blas(void* blas) noexcept;

/// x (rows × cols, row-major, device memory) orthogonalised as cpu::newton_schulz() does it,
/// step for step, then scaled (cpu::NsOptions): products by cuBLAS's SGEMM on `blas`, so the
/// sums run in another order than the CPU's and the result is close to it, not bitwise.
/// `scratch`: cpu::newton_schulz_scratch(rows, cols) device floats; `sums` two device doubles
/// and `workspace` kSumSquaresWorkspaceBytes device bytes (the norm, as
/// sum_squares_nonfinite() takes them).
void newton_schulz(float* x, int64_t rows, int64_t cols, const cpu::NsOptions& o, float* scratch,
                   double* sums, void* workspace, void* blas, StreamHandle stream);

}  // namespace zeroshard::cuda
