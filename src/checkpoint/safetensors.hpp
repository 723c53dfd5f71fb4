#pragma once
// The safetensors format (huggingface/safetensors): an 8-byte little-endian header length, a
// JSON header {"name": {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}
// padded with spaces to 8 bytes, then the tensors' bytes back to back in the header's order.
// Written streaming (the header first: every size is known), read by tensor and range.
#include <cstdint>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include "base/unique_fd.hpp"
#include "src/checkpoint/format.hpp"

namespace zeroshard::ckpt {

struct StTensor {
  std::string name;
  std::string dtype;  ///< "F32", "BF16", "F16", ... as the format spells them
  std::vector<int64_t> shape;
  int64_t begin = 0, end = 0;  ///< byte offsets in the data section
};

/// The engine's names for the parameters of `units` in a safetensors file, in unit and parameter
/// order: each parameter's own name when those are unique over the model (as torch's qualified
/// names are), else "<unit>.<param>".
std::vector<std::string> tensor_names(const std::vector<UnitInfo>& units);

/// Bytes per element of a safetensors dtype ("F32", "BF16", "I64", "BOOL", ...); 0 for one this
/// project does not know.
int64_t dtype_bytes(const std::string& dtype);

class StWriter {
 public:
  /// Creates `path` (replacing a file there) for tensors of these names, shapes and dtypes (empty:
  /// every one F32).
  StWriter(std::filesystem::path path, const std::vector<std::string>& names,
           const std::vector<std::vector<int64_t>>& shapes,
           const std::map<std::string, std::string>& metadata,
           const std::vector<std::string>& dtypes = {});
  /// The next tensor bytes, in the order of the names: n f32 values, or raw bytes.
  void append(const float* data, int64_t n);
  void append_bytes(const void* data, int64_t bytes);
  /// Checks that every byte came, fsyncs.
  void finish();

 private:
  std::filesystem::path path_;
  UniqueFd fd_;
  int64_t at_ = 0, end_ = 0;
};

class StReader {
 public:
  /// Opens `path` and parses its header strictly: size bounds, JSON, every entry's dtype, shape
  /// and offsets (inside the file, matching the shape, back to back). Throws Error(corrupted)
  /// or Error(invalid_argument) naming the file and the tensor.
  explicit StReader(std::filesystem::path path);
  const std::vector<StTensor>& tensors() const { return tensors_; }
  const StTensor* find(const std::string& name) const;
  /// The file's __metadata__ (string values).
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  /// Tensor t's bytes, whole, into out.
  void read_bytes(const StTensor& t, void* out);
  /// Elements [offset, offset + n) of tensor t (F32, BF16 or F16) as f32 into out.
  void read_f32(const StTensor& t, int64_t offset, int64_t n, float* out);

 private:
  std::filesystem::path path_;
  UniqueFd fd_;
  int64_t data_start_ = 0;
  std::vector<StTensor> tensors_;
  std::map<std::string, size_t> index_;
  std::map<std::string, std::string> metadata_;
};

}  // namespace zeroshard::ckpt
