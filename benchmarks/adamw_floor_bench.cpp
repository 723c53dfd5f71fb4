// The arithmetic floor of a bitwise AdamW step on one core: the correctly rounded square root
// and division that every element of the update takes (m / (sqrt(v) + eps)), over arrays in L1,
// against the same loads and stores with an add and a multiply in their place. Compiled for the
// build machine (-march=native); check the vector width the compiler chose (objdump: vsqrtps and
// vdivps on zmm registers for 512 bits), as it may prefer 256 bits on some AVX-512 cores.
//
//   adamw_floor_bench [--n 4096] [--rounds 200000]
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

namespace {

template <class Op>
double ns_per_element(int n, int rounds, std::vector<float>& out, Op op) {
  const auto t0 = std::chrono::steady_clock::now();
  for (int r = 0; r < rounds; ++r) {
    const float eps = 1e-8f + float(r & 1) * 1e-12f;  // changes per round: no hoisting
    for (int i = 0; i < n; ++i) out[size_t(i)] = op(i, eps);
    asm volatile("" : : "r"(out.data()) : "memory");
  }
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return s / (double(n) * rounds) * 1e9;
}

}  // namespace

int main(int argc, char** argv) {
  int n = 4096, rounds = 200000;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!std::strcmp(argv[i], "--n")) n = std::atoi(argv[i + 1]);
    if (!std::strcmp(argv[i], "--rounds")) rounds = std::atoi(argv[i + 1]);
  }
  std::vector<float> m(static_cast<size_t>(n)), v(m), out(m);
  for (int i = 0; i < n; ++i) {
    m[size_t(i)] = 0.001f * float(i % 97);
    v[size_t(i)] = 1e-6f * float(1 + i % 89);
  }
  for (int pass = 0; pass < 3; ++pass) {
    const double root = ns_per_element(n, rounds, out, [&](int i, float eps) {
      return m[size_t(i)] / (std::sqrt(v[size_t(i)]) + eps);
    });
    const double plain = ns_per_element(
        n, rounds, out, [&](int i, float eps) { return m[size_t(i)] * (v[size_t(i)] + eps); });
    std::printf("%d elements in L1: sqrt and divide %.3f ns per element, add and multiply %.3f\n",
                n, root, plain);
  }
}
