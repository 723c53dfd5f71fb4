#pragma once
// Checking macros: every failed check throws zeroshard::Error with the expression that failed.
// They stay on in release builds (docs/DESIGN.md rule 2).

#include <cerrno>
#include <cstring>
#include <sstream>
#include <string>

#include "zeroshard/error.hpp"

namespace zeroshard::detail {
[[noreturn]] inline void fail(ErrorCode code, const std::string& msg) {
  throw Error(code, msg);
}
}  // namespace zeroshard::detail

/// Throws Error(code) with a message built from stream arguments: ZS_THROW(code, "x " << y).
#define ZS_THROW(code, stream_expr)                                        \
  do {                                                                     \
    std::ostringstream zs_os_;                                             \
    zs_os_ << stream_expr;                                                 \
    ::zeroshard::detail::fail(::zeroshard::ErrorCode::code, zs_os_.str()); \
  } while (0)

/// Internal invariant: throws ErrorCode::internal naming the expression and location.
#define ZS_CHECK(cond)                                                                           \
  do {                                                                                           \
    if (!(cond))                                                                                 \
      ZS_THROW(internal, "internal check failed: " #cond " at " << __FILE__ << ":" << __LINE__); \
  } while (0)

/// A syscall-style result (< 0 is failure with errno): throws io_error naming the call.
#define ZS_CHECK_SYS(expr, what)                                                  \
  do {                                                                            \
    if ((expr) < 0) {                                                             \
      int zs_e_ = errno;                                                          \
      ZS_THROW(io_error, what << ": " #expr " failed: " << std::strerror(zs_e_)); \
    }                                                                             \
  } while (0)
