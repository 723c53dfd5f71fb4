#pragma once
/// \file checkpoint.hpp
/// Reading a checkpoint written by Engine::save() without an engine or ranks: what
/// `zeroshard ckpt inspect` and `zeroshard ckpt verify` run.
#include <cstdint>
#include <filesystem>
#include <functional>
#include <string>

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

}  // namespace zeroshard
