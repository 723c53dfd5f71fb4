#include "zeroshard/types.hpp"

#include <sstream>

#include "zeroshard/error.hpp"
#include "zeroshard/memory.hpp"
#include "zeroshard/version.hpp"

namespace zeroshard {

const char* dtype_name(DType t) {
  switch (t) {
    case DType::f32:
      return "f32";
    case DType::bf16:
      return "bf16";
    case DType::f16:
      return "f16";
  }
  return "?";
}

const char* tier_name(Tier t) {
  switch (t) {
    case Tier::device:
      return "device";
    case Tier::host:
      return "host";
    case Tier::nvme:
      return "nvme";
  }
  return "?";
}

const char* mem_kind_name(MemKind k) {
  switch (k) {
    case MemKind::param:
      return "param";
    case MemKind::grad:
      return "grad";
    case MemKind::master:
      return "master";
    case MemKind::optim_state:
      return "optim_state";
    case MemKind::buffer:
      return "buffer";
  }
  return "?";
}

const char* error_code_name(ErrorCode c) {
  switch (c) {
    case ErrorCode::invalid_argument:
      return "invalid_argument";
    case ErrorCode::invalid_config:
      return "invalid_config";
    case ErrorCode::model_mismatch:
      return "model_mismatch";
    case ErrorCode::timeout:
      return "timeout";
    case ErrorCode::comm_failure:
      return "comm_failure";
    case ErrorCode::io_error:
      return "io_error";
    case ErrorCode::corrupted:
      return "corrupted";
    case ErrorCode::no_space:
      return "no_space";
    case ErrorCode::cuda_error:
      return "cuda_error";
    case ErrorCode::overflow:
      return "overflow";
    case ErrorCode::internal:
      return "internal";
  }
  return "?";
}

int64_t shape_numel(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

std::string shape_string(const std::vector<int64_t>& shape) {
  std::ostringstream os;
  os << '[';
  for (size_t i = 0; i < shape.size(); ++i) os << (i ? ", " : "") << shape[i];
  os << ']';
  return os.str();
}

const char* version() {
  return "0.1.0";
}

}  // namespace zeroshard
