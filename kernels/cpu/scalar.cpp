// The reference ISA: the shared templates instantiated with one float per "vector".

#include "kernels/cpu/isa_table.hpp"
#include "kernels/cpu/scalar_vec.hpp"

namespace zeroshard::cpu {

const KernelTable& scalar_kernels() {
  static constexpr KernelTable table = make_kernel_table<ScalarVec>();
  return table;
}

}  // namespace zeroshard::cpu
