#pragma once
// The checkpoint format: a root directory of tags, each tag a directory of one manifest and one
// data file per (writing rank, state), all checksummed.
//
//   root/latest                   the newest complete tag's name, replaced atomically last
//   root/<tag>/manifest.json      the model, the step, hyperparameters, scaler, who wrote what
//   root/<tag>/rank00003.master   data files: header block, data, checksum table
//
// A data file holds, for each unit in order, the unpadded range of the unit's values that its
// rank's shard held when it was written (the manifest lists the ranges), each range encoded as
// encoding.hpp says: the master in f32, the moments in the run's state format. Its layout:
//   [0, 4096)                     header: FileHeader, then zeros
//   [4096, 4096 + data_bytes)     data
//   then                          one XXH64 per block of block_bytes (the last block may be
//                                 short), seeded with the block's index, then the XXH64 of the
//                                 table itself
// File names are never read from the manifest: they are made from the rank and the state.
#include <cstdint>
#include <filesystem>
#include <string>
#include <string_view>
#include <vector>

#include "zeroshard/engine.hpp"

namespace zeroshard::ckpt {

/// Schema 3 added the moments' format (state_format, state_block); a schema-2 checkpoint holds
/// f32 moments and reads as one. Schema 4 changed the 8-bit code (zeroshard/quantize.hpp) from
/// the dynamic map of bitsandbytes to small floats: a schema-3 checkpoint's 8-bit moments are
/// codes of that map, which load() widens and quantizes again (encoding.hpp).
constexpr int kSchema = 4;
constexpr int kOldestSchema = 2;
constexpr const char* kFormat = "zeroshard-checkpoint";
constexpr int64_t kHeaderBytes = 4096;
constexpr int64_t kBlockBytes = int64_t(4) << 20;

/// The states a checkpoint can hold, by their names in file names and the manifest.
struct StateName {
  StateKind kind;
  const char* name;
};
const std::vector<StateName>& state_names();

/// "rank00003.master".
std::string data_file_name(int rank, const char* state);

/// Refuses a tag that is not a plain directory name (empty, ".", "..", a '/', a NUL, a leading
/// '.', which temporary directories use, or over 200 bytes).
void check_tag(const std::string& tag);

/// The fixed part of a data file's header.
struct FileHeader {
  uint64_t save_id = 0;  ///< the save that wrote it (the manifest's); files of two saves never mix
  int32_t rank = 0;      ///< the writing rank
  int32_t state = 0;     ///< index into state_names()
  int64_t block_bytes = 0;
  int64_t data_bytes = 0;
};
/// kHeaderBytes bytes: magic, schema, the fields, and an XXH64 of what precedes it.
std::vector<char> encode_header(const FileHeader& h);
/// Parses and checks a header block; throws Error(corrupted) naming `file` on any damage.
FileHeader decode_header(const char* data, size_t bytes, const std::string& file);

/// Blocks of a file holding data_bytes in blocks of block_bytes.
int64_t block_count(int64_t data_bytes, int64_t block_bytes);
/// The file's whole size.
int64_t file_bytes(const FileHeader& h);

/// One unit's range in one rank's data files: values [begin, end) of the unit, after `offset`
/// values of the rank's earlier ranges (at byte range_bytes() of each data file).
struct Range {
  int unit = 0;
  int64_t begin = 0, end = 0, offset = 0;
};

struct ParamInfo {
  std::string name;
  std::vector<int64_t> shape;
  int group = -1;  ///< its parameter group; -1: not recorded (a checkpoint written before)
};
struct UnitInfo {
  std::string name;
  int64_t numel = 0;
  std::vector<ParamInfo> params;
};

/// Everything a checkpoint says about itself.
struct Manifest {
  std::string tag;
  uint64_t save_id = 0;
  int world_size = 0;
  int stage = 0;
  std::string dtype, optimizer;
  int64_t step = 0;
  LossScalerState scaler;
  std::vector<OptimizerOptions> groups;
  std::vector<std::string> states;              ///< the state names saved
  StateFormat state_format = StateFormat::f32;  ///< the moments' (encoding.hpp)
  int64_t state_block = 0;                      ///< q8: values per block
  bool q8_dynamic_map = false;                  ///< q8 of schema 3: the dynamic map's codes
  int64_t block_bytes = 0;
  std::vector<UnitInfo> units;
  std::vector<std::vector<Range>> ranges;  ///< per writing rank
};

/// Values [begin, end) of a unit that rank r's shard holds (empty when it holds only padding),
/// as Range{0, begin, end, 0}.
Range owned_by(const ShardInfo& s, int r);
/// The header rank r's data file of state s (an index into state_names()) must carry.
FileHeader expected_header(const Manifest& m, int rank, int state);
/// Where each of rank r's ranges starts in its data file of state s, in data bytes.
std::vector<int64_t> range_bytes(const Manifest& m, int rank, int state);

/// The manifest as JSON text, with its own checksum.
std::string manifest_text(const Manifest& m);
/// v as 16 hex digits, as the manifest, the module file and temporary names spell save ids and
/// checksums.
std::string hex64(uint64_t v);
/// Parses and validates a manifest (schema, every field's type and range, the ranges cover
/// every unit exactly once, the checksum); throws Error(corrupted) or, for another schema or
/// format, Error(invalid_argument), naming `file` and the field.
Manifest parse_manifest(std::string_view text, const std::string& file);

/// The tag directory a load() of `path` reads: `path` itself if it holds a manifest, else the
/// tag named by path/latest. Throws Error(invalid_argument) if neither.
std::filesystem::path resolve(const std::filesystem::path& path);

/// The whole manifest of a tag directory.
Manifest read_manifest(const std::filesystem::path& tag_dir);

}  // namespace zeroshard::ckpt
