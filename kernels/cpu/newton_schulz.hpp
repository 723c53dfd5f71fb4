#pragma once
// Muon's kernels on the CPU: the momentum average a matrix's direction is made from, and its
// orthogonalisation, the quintic Newton-Schulz iteration of Jordan et al., as torch.optim.Muon
// runs it. The matrix products go through OpenBLAS's SGEMM where the build has it
// (ZS_HAVE_BLAS), else through plain loops (a machine without it, e.g. a bare GPU host). The GPU
// runs the same steps with cuBLAS (kernels/cuda/muon.cu).

#include <cstdint>
#include <vector>

#include "kernels/cpu/cpu_kernels.hpp"

namespace zeroshard::cpu {

/// The published quintic coefficients (a, b, c) of torch.optim.Muon and Jordan et al.
inline constexpr float kNsA = 3.4445f, kNsB = -4.7750f, kNsC = 2.0315f;

/// x (rows × cols, row-major) replaced by its orthogonalisation: with X = x / max(‖x‖_F, eps),
/// transposed first when rows > cols so that X is m × n with m <= n, `steps` times
///   A = X·Xᵀ;  B = b·A + c·A·A;  X = a·X + B·X,
/// and transposed back. With `bf16` every matrix is rounded to bf16 (to nearest even) where
/// torch.optim.Muon holds it in bf16 (the input, X after each step, A and B); the products sum
/// in f32 either way. `scratch` holds newton_schulz_scratch(rows, cols) floats.
void newton_schulz(float* x, int64_t rows, int64_t cols, int steps, float eps, bool bf16,
                   float* scratch);

/// Floats of scratch newton_schulz() takes for a rows × cols matrix (2mn + 2m², m <= n): its
/// X and the next X, A and B. The GPU's iteration takes the same (kernels/cuda/muon.cu).
inline int64_t newton_schulz_scratch(int64_t rows, int64_t cols) {
  const int64_t m = rows < cols ? rows : cols, n = rows < cols ? cols : rows;
  return 2 * m * n + 2 * m * m;
}

/// One matrix's orthogonalisation as the engine asks for it: newton_schulz() with these
/// settings, then every element multiplied by `scale` (the shape's learning-rate factor).
struct NsOptions {
  int steps = 5;
  float eps = 1e-7f;
  bool bf16 = false;
  float scale = 1.0f;
};

/// Muon's direction over elements [lo, hi) of the update `a` describes (a's extent), with its
/// matrix's group's hyperparameters h: with g = grad · grad_scale and m the stored momentum,
/// m' = μ·m + (1 − μ)·g, and d[i − lo] = (1 − μ)·g + μ·m' with Nesterov, else m' — the same
/// operations the update repeats when it stores m' (update_impl.hpp). 8-bit moments are widened
/// whole blocks at a time, as the update dequantizes them, into `wide` (grown as needed).
void muon_average(Isa isa, const UpdateArgs& a, const UpdateHyper& h, int64_t lo, int64_t hi,
                  float* d, std::vector<float>& wide);

/// Multiply-adds of newton_schulz() on a rows × cols matrix: what owners are balanced by.
double newton_schulz_cost(int64_t rows, int64_t cols, int steps);

/// Which rank orthogonalises each of one unit's matrices, whose newton_schulz_cost() are `cost`
/// (in the unit's order): the costliest first (ties in the unit's order), each to the rank with
/// the least work in this unit so far, then the least over the whole model (`load`, one entry
/// per rank of the shard group, added to here), then the lowest rank. So each unit's iteration
/// is spread over the group, and so is the model's. The engine (src/engine_muon.cpp) and the
/// planner's step time (src/planner/plan_time.cpp) both take their owners from here.
std::vector<int> assign_owners(const std::vector<double>& cost, std::vector<double>& load);

/// Whether this build multiplies with OpenBLAS (else plain loops).
bool newton_schulz_uses_blas();

}  // namespace zeroshard::cpu
