#pragma once
// Checking macros for the CUDA runtime, in the style of check.hpp: a failed call throws
// zeroshard::Error(cuda_error) with the expression, the place and CUDA's own description.
// Internal header: it includes the CUDA runtime API and must not reach include/zeroshard/.

#include <cuda_runtime_api.h>

#include "base/check.hpp"

/// Throws Error(cuda_error): "<expr> failed at file:line: cudaErrorX: <description>".
#define ZS_CUDA_CHECK(expr)                                                           \
  do {                                                                                \
    const cudaError_t zs_cu_ = (expr);                                                \
    if (zs_cu_ != cudaSuccess)                                                        \
      ZS_THROW(cuda_error, #expr " failed at " << __FILE__ << ":" << __LINE__ << ": " \
                                               << cudaGetErrorName(zs_cu_) << ": "    \
                                               << cudaGetErrorString(zs_cu_));        \
  } while (0)

/// As ZS_CUDA_CHECK, with a leading context (the rank, unit or kernel) in the message.
#define ZS_CUDA_CHECK_CTX(expr, ctx_stream)                                                      \
  do {                                                                                           \
    const cudaError_t zs_cu_ = (expr);                                                           \
    if (zs_cu_ != cudaSuccess)                                                                   \
      ZS_THROW(cuda_error, ctx_stream << ": " #expr " failed at " << __FILE__ << ":" << __LINE__ \
                                      << ": " << cudaGetErrorName(zs_cu_) << ": "                \
                                      << cudaGetErrorString(zs_cu_));                            \
  } while (0)

/// Checks a kernel launch (the launch itself; execution errors show at the next sync). Clears
/// the error it reports, so a failed launch does not poison later, unrelated checks.
#define ZS_CUDA_CHECK_LAUNCH(kernel_name) \
  ZS_CUDA_CHECK_CTX(cudaGetLastError(), "launch of " << kernel_name)

namespace zeroshard::cuda {

/// Destructor-safe variant: returns false instead of throwing (for cleanup paths, which must
/// never throw; the caller decides whether the failure matters).
inline bool cuda_ok(cudaError_t e) noexcept {
  return e == cudaSuccess;
}

}  // namespace zeroshard::cuda
