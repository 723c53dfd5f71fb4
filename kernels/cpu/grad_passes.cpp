// The gradient passes on the arena (see grad_passes.hpp).
#include "kernels/cpu/grad_passes.hpp"

namespace zeroshard::cpu {

double parallel_sum_squares(Arena& arena, const void* x, DType dtype, int64_t n) {
  const size_t xs = dtype_size(dtype);
  return arena.parallel_sum(n, [&](int64_t b, int64_t e) {
    return sum_squares(arena.isa(), static_cast<const char*>(x) + size_t(b) * xs, dtype, e - b);
  });
}

double fold_grad(Arena& arena, float* acc, const void* g, DType g_dtype, int64_t n, bool first,
                 bool sum) {
  const Isa isa = arena.isa();
  const size_t gs = dtype_size(g_dtype);
  auto fold = [&](int64_t b, int64_t e) {
    const char* src = static_cast<const char*>(g) + size_t(b) * gs;
    if (first)
      convert(isa, src, g_dtype, acc + b, DType::f32, e - b);
    else
      accumulate(isa, acc + b, src, g_dtype, e - b);
  };
  if (!sum) {
    arena.parallel_chunks(n, fold);
    return 0.0;
  }
  return arena.parallel_sum(n, [&](int64_t b, int64_t e) {
    fold(b, e);
    return sum_squares(isa, acc + b, DType::f32, e - b);
  });
}

}  // namespace zeroshard::cpu
