#pragma once
// The per-ISA entry points behind cpu_kernels.hpp. Each ISA file (scalar.cpp, avx2.cpp,
// avx512.cpp) instantiates the shared templates with its vector type and exports one table;
// dispatch.cpp validates arguments and picks the table. Tables are constant-initialised, so
// nothing compiled with -mavx512f runs before the CPU has been checked.

#include <cstdint>

#include "kernels/cpu/cpu_kernels.hpp"

namespace zeroshard::cpu {

/// Most read (and write) streams same_bytes accepts; an update touches at most five.
inline constexpr int kMaxSameBytesStreams = 8;

struct KernelTable {
  void (*optimizer_update)(const UpdateHyper& h, const UpdateArgs& a);
  void (*optimizer_update_segments)(const UpdateSegment* segments, int count, const UpdateArgs& a);
  void (*quantize_blocks)(const float* x, int64_t n, int64_t block, bool is_signed, uint8_t* q,
                          float* absmax);
  void (*dequantize_blocks)(const uint8_t* q, const float* absmax, int64_t n, int64_t block,
                            bool is_signed, float* x);
  double (*sum_squares)(const void* x, DType dtype, int64_t n);
  void (*convert)(const void* src, DType src_dtype, void* dst, DType dst_dtype, int64_t n);
  void (*accumulate)(float* acc, const void* g, DType g_dtype, int64_t n);
  void (*add_into)(void* inout, const void* in, DType dtype, int64_t n);
  void (*same_bytes)(const float* const* reads, int read_streams, float* const* writes,
                     int write_streams, int64_t n);
};

const KernelTable& scalar_kernels();
const KernelTable& avx2_kernels();
const KernelTable& avx512_kernels();

}  // namespace zeroshard::cpu
