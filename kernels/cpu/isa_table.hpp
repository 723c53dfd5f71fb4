#pragma once
// Builds the KernelTable an ISA file exports: every shared template instantiated with that
// file's vector type. Constant-initialised, so no ISA-specific code runs at load time.

#include "kernels/cpu/elementwise_impl.hpp"
#include "kernels/cpu/kernel_table.hpp"
#include "kernels/cpu/update_impl.hpp"

namespace zeroshard::cpu {
namespace {

template <class V>
constexpr KernelTable make_kernel_table() {
  return KernelTable{&optimizer_update_impl<V>, &optimizer_update_segments_impl<V>,
                     &quantize_blocks_impl<V>,  &dequantize_blocks_impl<V>,
                     &sum_squares_impl<V>,      &convert_impl<V>,
                     &accumulate_impl<V>,       &add_into_impl<V>,
                     &same_bytes_impl<V>};
}

}  // namespace
}  // namespace zeroshard::cpu
