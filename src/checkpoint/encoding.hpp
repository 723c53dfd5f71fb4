#pragma once
// How a checkpoint's data file stores one state's values: the master always as f32, the moments
// as the run kept them (the manifest's state_format), so that an 8-bit run's checkpoint is as
// small as its state and reloads to the same bits.
//
// A data file is its rank's ranges back to back (format.hpp), each range encoded on its own:
//   f32   4 bytes per value
//   bf16  2 bytes per value (the values' own bits: a bf16 state widens and narrows exactly)
//   q8    per block of `block` values counted from the range's first value (the last block may
//         be shorter): the block's f32 absmax, then one code byte per value (zeroshard/
//         quantize.hpp; in a schema-3 checkpoint, a code of the dynamic map: Encoding)
// A shard starts on a block boundary of its unit at every world size (layout.hpp,
// padding_grain), so a range's blocks are the run's own blocks: saving and loading at any world
// size with the same format and block keeps every code and absmax bit for bit.
#include <cstdint>

#include "zeroshard/config.hpp"

namespace zeroshard::ckpt {

struct Manifest;

struct Encoding {
  StateFormat format = StateFormat::f32;
  int64_t block = 0;       ///< q8 only
  bool is_signed = false;  ///< q8 only: the signed code (first moments) or the unsigned one
  /// q8 of a schema-3 checkpoint: codes of the dynamic map that zeroshard kept 8-bit moments
  /// in before (Dettmers et al., 7 decimal exponents, as bitsandbytes), which only decode()
  /// reads; a load widens them and quantizes them again.
  bool dynamic_map = false;
};

/// The encoding of state s (an index into state_names()) in the checkpoint of manifest m.
Encoding encoding_of(const Manifest& m, int s);

/// Whether a tier that stores moments as `format`, 8-bit ones in blocks of `block`, takes e's
/// bytes as they are (unpack()) rather than widened (decode()): the same format and blocks, and
/// not the dynamic map of schema 3.
bool unpacks_into(const Encoding& e, StateFormat format, int64_t block);

/// Bytes of a range of n values.
int64_t encoded_bytes(const Encoding& e, int64_t n);

/// The bytes [first, last) of a range of n values, relative to the range's start, that hold
/// its values [lo, hi) (q8: whole blocks).
struct ByteSpan {
  int64_t first = 0, last = 0;
};
ByteSpan span_of(const Encoding& e, int64_t n, int64_t lo, int64_t hi);

/// Encodes the n values of a range, given in f32, into `out` (encoded_bytes(e, n) bytes).
void encode(const Encoding& e, const float* values, int64_t n, char* out);

/// Values [lo, hi) of a range of n values out of span_of(e, n, lo, hi)'s bytes, as f32.
void decode(const Encoding& e, int64_t n, int64_t lo, int64_t hi, const char* bytes, float* out);

/// The same without a conversion, for a tier that stores the values in e.format: n values as
/// stored (q8: the codes, and `absmax` per block from the range's first value) into `out`.
void pack(const Encoding& e, const void* data, const float* absmax, int64_t n, char* out);
/// Values [lo, hi) of a range of n values, lo on a block boundary (q8), out of
/// span_of(e, n, lo, hi)'s bytes into storage: `data` receives value lo first, and for q8
/// `absmax` the absmax of the block starting at lo first.
void unpack(const Encoding& e, int64_t n, int64_t lo, int64_t hi, const char* bytes, void* data,
            float* absmax);

}  // namespace zeroshard::ckpt
