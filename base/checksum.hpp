#pragma once
// Checksums of swapped blocks: XXH64 (Yann Collet's public algorithm, implemented here from its
// specification). It runs at memory speed on one core, far above any NVMe drive, so the I/O
// thread can hash every block it writes and verify every block it reads without slowing the
// swap down; 64 bits make an undetected corruption of a block practically impossible.

#include <cstddef>
#include <cstdint>

namespace zeroshard::offload {

/// XXH64 of `len` bytes at `data` with `seed`. The swapper seeds each block with its logical
/// offset, so a block read from the wrong place fails the check even if its bytes are intact.
uint64_t xxh64(const void* data, size_t len, uint64_t seed);

}  // namespace zeroshard::offload
