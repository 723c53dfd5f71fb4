#pragma once
// A load's reads of a checkpoint: the blocks holding this rank's values of every f32 state, read
// as fio reads a file (many whole-block reads in flight, O_DIRECT, in file order), each verified
// as it lands where the values go. What a block holds for several units, or only partly for this
// rank, comes through a buffer of the reader's own.
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

/// Opens every data file the targets read from: each file's header and checksum table are read
/// and checked (small reads), nothing else. Throws as read_blocks() does.
void check_files(const std::filesystem::path& dir, const Manifest& m,
                 const std::vector<ReadTarget>& targets);

/// Reads every target from the checkpoint in `dir` (manifest m), each block verified as it
/// lands. Every target's state must be stored in f32 (encoding.hpp): the values land as the file
/// holds them. Throws Error(corrupted) naming file, block and offset on damage, Error(io_error)
/// on a failed read; the targets may then hold part of what was read.
void read_blocks(const std::filesystem::path& dir, const Manifest& m,
                 const std::vector<ReadTarget>& targets);

}  // namespace zeroshard::ckpt
