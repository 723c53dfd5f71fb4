#pragma once
// Muon's orthogonalisation on the CPU: the quintic Newton-Schulz iteration of Jordan et al., as
// torch.optim.Muon runs it. The matrix products go through OpenBLAS's SGEMM where the build has
// it (ZS_HAVE_BLAS), else through plain loops (a machine without it, e.g. a bare GPU host).

#include <cstdint>
#include <vector>

namespace zeroshard::cpu {

/// The published quintic coefficients (a, b, c) of torch.optim.Muon and Jordan et al.
inline constexpr float kNsA = 3.4445f, kNsB = -4.7750f, kNsC = 2.0315f;

/// x (rows × cols, row-major) replaced by its orthogonalisation: with X = x / max(‖x‖_F, eps),
/// transposed first when rows > cols so that X is m × n with m <= n, `steps` times
///   A = X·Xᵀ;  B = b·A + c·A·A;  X = a·X + B·X,
/// and transposed back. With `bf16` every matrix is rounded to bf16 (to nearest even) where
/// torch.optim.Muon holds it in bf16 (the input, X after each step, A and B); the products sum
/// in f32 either way. `scratch` is grown as needed and may be reused across calls.
void newton_schulz(float* x, int64_t rows, int64_t cols, int steps, float eps, bool bf16,
                   std::vector<float>& scratch);

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
