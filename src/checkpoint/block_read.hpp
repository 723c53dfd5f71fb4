#pragma once
// A load's passes over a checkpoint: the blocks holding this rank's values of every state, read
// as fio reads a file (many whole-block reads in flight, O_DIRECT, in file order), each verified,
// and either only verified or written to where the values go. What a block holds for several
// units, or only partly for this rank, comes through a buffer of the reader's own.
#include <cstdint>
#include <filesystem>
#include <vector>

#include "src/checkpoint/format.hpp"

namespace zeroshard::ckpt {

/// Values [b, e) of unit u's state s (an index into state_names()) go to `out` (host memory).
struct ReadTarget {
  int s, u;
  int64_t b, e;
  float* out;
};

/// Reads every target from the checkpoint in `dir` (manifest m); with `verify_only`, reads and
/// verifies the blocks they take and writes nothing (`out` may be null). Without it every
/// target's state must be stored in f32 (encoding.hpp): the values land as the file holds them.
/// Throws Error(corrupted) naming file, block and offset on damage, Error(io_error) on a failed
/// read; the targets may then hold part of what was read.
void read_blocks(const std::filesystem::path& dir, const Manifest& m,
                 const std::vector<ReadTarget>& targets, bool verify_only);

}  // namespace zeroshard::ckpt
