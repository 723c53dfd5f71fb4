#pragma once
// Checking macros for MPI, in the style of check.hpp and cuda_check.hpp: a failed call throws
// zeroshard::Error(comm_failure) with the expression, the place and MPI's own error string.
// Internal header: it includes mpi.h and must not reach include/zeroshard/. The communicator
// sets MPI_ERRORS_RETURN on its communicators, so failures come back as results to check.

#include <mpi.h>

#include <string>

#include "base/check.hpp"

namespace zeroshard::mpi {

/// MPI's description of the error code `rc` ("MPI_ERR_TRUNCATE: message truncated").
inline std::string error_string(int rc) {
  char buf[MPI_MAX_ERROR_STRING];
  int len = 0;
  if (MPI_Error_string(rc, buf, &len) != MPI_SUCCESS) return "MPI error " + std::to_string(rc);
  return std::string(buf, size_t(len));
}

}  // namespace zeroshard::mpi

/// Throws Error(comm_failure): "<expr> failed at file:line: <MPI's error string>".
#define ZS_MPI_CHECK(expr)                                                                       \
  do {                                                                                           \
    const int zs_mpi_rc_ = (expr);                                                               \
    if (zs_mpi_rc_ != MPI_SUCCESS)                                                               \
      ZS_THROW(comm_failure, #expr " failed at " << __FILE__ << ":" << __LINE__ << ": "          \
                                                 << ::zeroshard::mpi::error_string(zs_mpi_rc_)); \
  } while (0)

/// As ZS_MPI_CHECK, with a leading context (the rank and the collective) in the message.
#define ZS_MPI_CHECK_CTX(expr, ctx_stream)                                                         \
  do {                                                                                             \
    const int zs_mpi_rc_ = (expr);                                                                 \
    if (zs_mpi_rc_ != MPI_SUCCESS)                                                                 \
      ZS_THROW(comm_failure, ctx_stream << ": " #expr " failed at " << __FILE__ << ":" << __LINE__ \
                                        << ": " << ::zeroshard::mpi::error_string(zs_mpi_rc_));    \
  } while (0)
