#pragma once
/// \file error.hpp
/// The one error type that crosses zeroshard's public edge.

#include <stdexcept>
#include <string>

#include "zeroshard/export.hpp"

namespace zeroshard {

/// What went wrong, coarsely; the message says exactly what.
enum class ErrorCode {
  invalid_argument,  ///< a caller passed something the contract forbids (sizes, dtypes, order)
  invalid_config,    ///< a configuration key is unknown, has the wrong type or a bad value
  model_mismatch,    ///< ranks registered different models; raised on every rank
  timeout,           ///< a collective did not complete in time
  comm_failure,      ///< the communication backend reported an error (or a timeout broke it)
  io_error,          ///< a file or device operation failed
  corrupted,         ///< data read back failed its checksum or has the wrong size
  no_space,          ///< a tier ran out of room (ENOSPC, a full pool)
  cuda_error,        ///< a CUDA runtime or NCCL call failed
  overflow,          ///< gradients overflowed with the loss scale at its minimum: no step can go on
  internal,          ///< an invariant inside zeroshard broke; a bug, please report it
};
ZS_API const char* error_code_name(ErrorCode c);

/// Exception thrown by every public zeroshard call. what() names the rank, the unit and the call
/// where they are known, e.g. "rank 1: reduce_scatter of unit 'layer3' timed out after 5 s".
class ZS_API Error : public std::runtime_error {
 public:
  Error(ErrorCode code, const std::string& message) : std::runtime_error(message), code_(code) {}
  ErrorCode code() const noexcept { return code_; }

 private:
  ErrorCode code_;
};

}  // namespace zeroshard
