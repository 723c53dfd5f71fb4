#pragma once
// Checking macros for NCCL, in the style of check.hpp and cuda_check.hpp: a failed call throws
// zeroshard::Error with the expression, the place, NCCL's error string and, when a communicator
// is given, NCCL's last error message for it. Internal header: it includes nccl.h and must not
// reach include/zeroshard/.

#include <nccl.h>

#include <string>

#include "base/check.hpp"

namespace zeroshard::nccl {

/// NCCL's description of `rc`, with the communicator's last error message if there is one.
inline std::string error_string(ncclResult_t rc, ncclComm_t comm = nullptr) {
  std::string s = ncclGetErrorString(rc);
  const char* last = ncclGetLastError(comm);
  if (last != nullptr && *last != '\0') s += std::string(" (") + last + ")";
  return s;
}

}  // namespace zeroshard::nccl

/// Throws Error(cuda_error): "<expr> failed at file:line: <NCCL's error string>".
#define ZS_NCCL_CHECK(expr) ZS_NCCL_CHECK_CTX(cuda_error, nullptr, expr, "NCCL")

/// Throws Error(code): "<ctx>: <expr> failed at file:line: <NCCL's error string> (<last
/// error of comm>)". `comm` may be null.
#define ZS_NCCL_CHECK_CTX(code, comm, expr, ctx_stream)                                            \
  do {                                                                                             \
    const ncclResult_t zs_nccl_rc_ = (expr);                                                       \
    if (zs_nccl_rc_ != ncclSuccess)                                                                \
      ZS_THROW(code, ctx_stream << ": " #expr " failed at " << __FILE__ << ":" << __LINE__ << ": " \
                                << ::zeroshard::nccl::error_string(zs_nccl_rc_, comm));            \
  } while (0)

/// For calls on a non-blocking communicator, which may return ncclInProgress (the call goes on
/// asynchronously; poll ncclCommGetAsyncError): stores the result in `rc` and throws as
/// ZS_NCCL_CHECK_CTX only on a real failure.
#define ZS_NCCL_CHECK_ASYNC(rc, code, comm, expr, ctx_stream)                                      \
  do {                                                                                             \
    (rc) = (expr);                                                                                 \
    if ((rc) != ncclSuccess && (rc) != ncclInProgress)                                             \
      ZS_THROW(code, ctx_stream << ": " #expr " failed at " << __FILE__ << ":" << __LINE__ << ": " \
                                << ::zeroshard::nccl::error_string(rc, comm));                     \
  } while (0)
