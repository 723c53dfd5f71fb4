#pragma once
/// \file checkpoint.hpp
/// Reading a checkpoint written by Engine::save() without an engine or ranks: what
/// `zeroshard ckpt inspect` and `zeroshard ckpt verify` run.
#include <cstdint>
#include <filesystem>
#include <functional>
#include <string>

#include "zeroshard/engine.hpp"
#include "zeroshard/export.hpp"

namespace zeroshard {

/// The manifest of the checkpoint at `path` (a tag directory, or a root whose `latest` names
/// one) as a human-readable table: tag, step, world size, stage, dtype, optimizer, loss scaler,
/// every group's hyperparameters, and every unit with its parameters' names and shapes. Checks
/// the manifest (not the data); throws Error(corrupted or invalid_argument) with the reason.
ZS_API std::string describe_checkpoint(const std::filesystem::path& path);

/// Verifies every file of the checkpoint at `path`: each header, checksum table and block.
/// `progress(done_bytes, total_bytes)` is called after each block. Returns the data bytes
/// verified; throws Error(corrupted) naming the file, the block and its offset on damage.
ZS_API int64_t verify_checkpoint(const std::filesystem::path& path,
                                 const std::function<void(int64_t, int64_t)>& progress = {});

/// What the checkpoint at `path` carries of the model besides the engine's state (the `module`
/// given to Engine::save()): tensors and aliases, checked (Error(corrupted) naming the file on
/// damage); empty where the save was given none.
ZS_API ModuleState read_module_state(const std::filesystem::path& path);

/// Hugging Face's default shard size limit (save_pretrained's max_shard_size="5GB").
inline constexpr int64_t kExportShardBytes = 5'000'000'000;

/// Writes the checkpoint at `path` as safetensors files in `out_dir`, as Hugging Face loads
/// them: model.safetensors holds every parameter's f32 master weights (named as the model
/// names them: the parameters' own names when unique over the model, else "<unit>.<param>"),
/// each alias of one (tied weights) as a copy under its own name, and the module's tensors
/// (frozen parameters, buffers) in their dtypes, so that every name of the model's state_dict
/// is there. Above `max_shard_bytes` (0: never) the model is split into
/// model-00001-of-0000N.safetensors ... with model.safetensors.index.json naming each tensor's
/// file. optimizer.safetensors holds the optimizer state per parameter ("<name>.exp_avg",
/// "<name>.exp_avg_sq"; SGD "<name>.momentum_buffer"). Streams unit by unit and tensor by
/// tensor: memory is one unit's values or one module tensor. Every block and the module file
/// are verified on the way. `progress(done_bytes, total_bytes)` after each unit. The files
/// appear complete or not at all.
ZS_API void export_checkpoint(const std::filesystem::path& path,
                              const std::filesystem::path& out_dir,
                              const std::function<void(int64_t, int64_t)>& progress = {},
                              int64_t max_shard_bytes = kExportShardBytes);

}  // namespace zeroshard
