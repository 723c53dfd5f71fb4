#pragma once
// module.safetensors: what a checkpoint carries of the model besides the engine's state
// (ModuleState, zeroshard/engine.hpp): the model's tensors the engine does not train, each in
// its own dtype under its state_dict name, and the other names of trained parameters (tied
// weights). Rank 0 writes it into the tag with the data files. Its __metadata__ ties it to its
// save and checks it:
//   "format": "zeroshard-module", "save_id": the manifest's save id (16 hex digits),
//   "xxh64": the XXH64 of every tensor's bytes in file order, each seeded with the one before
//            (the first with 0), "aliases": a JSON object {name: the trained parameter's name}.
#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include "src/checkpoint/safetensors.hpp"
#include "zeroshard/engine.hpp"

namespace zeroshard::ckpt {

inline constexpr const char* kModuleFile = "module.safetensors";

/// Writes `module` as dir/module.safetensors, fsynced, for the save `save_id`. `trained`: the
/// checkpoint's parameter names. A tensor named as a trained parameter or as another tensor,
/// an alias whose name is taken or whose target is no trained parameter, an unknown dtype, or
/// bytes that do not match the shape: Error(invalid_argument) naming it.
void write_module_file(const std::filesystem::path& dir, const ModuleState& module,
                       uint64_t save_id, const std::vector<std::string>& trained);

/// A module file read tensor by tensor: its format, save id and aliases checked on opening, its
/// tensors in file order (the order the checksum chains them in), the checksum checked by
/// finish() once each was read. Damage is Error(corrupted) naming the file.
class ModuleReader {
 public:
  ModuleReader(std::filesystem::path path, uint64_t save_id);
  const std::vector<std::pair<std::string, std::string>>& aliases() const { return aliases_; }
  const std::vector<const StTensor*>& tensors() const { return order_; }
  /// Tensor t's bytes into out; tensors are read in the order tensors() lists them.
  void read(const StTensor& t, void* out);
  void finish() const;

 private:
  std::filesystem::path path_;
  StReader r_;
  std::vector<std::pair<std::string, std::string>> aliases_;
  std::vector<const StTensor*> order_;
  size_t next_ = 0;
  uint64_t sum_ = 0;
};

/// dir/module.safetensors of the save `save_id`, checked (format, save id, checksum: else
/// Error(corrupted) naming the file); an empty state where the tag holds none.
ModuleState read_module_file(const std::filesystem::path& dir, uint64_t save_id);

}  // namespace zeroshard::ckpt
