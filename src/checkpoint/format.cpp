// The checkpoint format (format.hpp): names, the data files' header, the manifest and its
// strict parser. Nothing here trusts what it reads: every field is type- and range-checked
// before use, and an error names the file and the field.
#include "src/checkpoint/format.hpp"

#include <fcntl.h>
#include <sys/stat.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdio>
#include <cstring>
#include <limits>
#include <nlohmann/json.hpp>
#include <optional>

#include "base/check.hpp"
#include "base/checksum.hpp"
#include "base/unique_fd.hpp"
#include "src/checkpoint/encoding.hpp"
#include "src/checkpoint/file_io.hpp"

namespace zeroshard::ckpt {

using nlohmann::json;

const std::vector<StateName>& state_names() {
  static const std::vector<StateName> s = {
      {StateKind::master, "master"}, {StateKind::state0, "state0"}, {StateKind::state1, "state1"}};
  return s;
}

std::string data_file_name(int rank, const char* state) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "rank%05d.", rank);
  return buf + std::string(state);
}

void check_tag(const std::string& tag) {
  bool bad = tag.empty() || tag.size() > 200 || tag[0] == '.' ||
             tag.find('/') != std::string::npos || tag.rfind("latest", 0) == 0;
  for (unsigned char c : tag) bad |= c < 0x20 || c == 0x7f;  // NUL, newline, other controls
  if (bad)
    ZS_THROW(invalid_argument, "checkpoint: tag '"
                                   << tag
                                   << "' is not a plain directory name (1-200 bytes, no '/' or "
                                      "control character, not starting with '.' or 'latest')");
}

// ---- data file header ----------------------------------------------------------------------

namespace {
constexpr char kMagic[8] = {'Z', 'S', 'C', 'K', 'P', 'T', 'D', '\n'};
struct RawHeader {
  char magic[8];
  int32_t schema;
  int32_t rank;
  int32_t state;
  int32_t pad;
  uint64_t save_id;
  int64_t block_bytes;
  int64_t data_bytes;
  uint64_t check;  // XXH64 of the bytes before it
};
}  // namespace

std::vector<char> encode_header(const FileHeader& h) {
  std::vector<char> out(size_t(kHeaderBytes), 0);
  RawHeader r{};
  std::memcpy(r.magic, kMagic, sizeof kMagic);
  r.schema = kSchema;
  r.rank = h.rank;
  r.state = h.state;
  r.save_id = h.save_id;
  r.block_bytes = h.block_bytes;
  r.data_bytes = h.data_bytes;
  r.check = offload::xxh64(&r, offsetof(RawHeader, check), 0);
  std::memcpy(out.data(), &r, sizeof r);
  return out;
}

FileHeader decode_header(const char* data, size_t bytes, const std::string& file) {
  RawHeader r{};
  if (bytes < sizeof r)
    ZS_THROW(corrupted, "checkpoint: " << file << ": header is " << bytes << " bytes, too short");
  std::memcpy(&r, data, sizeof r);
  if (std::memcmp(r.magic, kMagic, sizeof kMagic) != 0)
    ZS_THROW(corrupted, "checkpoint: " << file << " is not a zeroshard data file (bad magic)");
  if (r.check != offload::xxh64(&r, offsetof(RawHeader, check), 0))
    ZS_THROW(corrupted, "checkpoint: " << file << ": header checksum mismatch (damaged header)");
  if (r.schema < kOldestSchema || r.schema > kSchema)
    ZS_THROW(invalid_argument, "checkpoint: " << file << " has schema " << r.schema << ", expected "
                                              << kOldestSchema << " to " << kSchema);
  const bool sane = r.rank >= 0 && r.state >= 0 && size_t(r.state) < state_names().size() &&
                    r.block_bytes >= 4096 && r.block_bytes % 4096 == 0 &&
                    r.block_bytes <= (int64_t(1) << 30) && r.data_bytes >= 0 &&
                    r.data_bytes <= (int64_t(1) << 50);
  if (!sane) ZS_THROW(corrupted, "checkpoint: " << file << ": header fields out of range");
  return {r.save_id, r.rank, r.state, r.block_bytes, r.data_bytes};
}

int64_t block_count(int64_t data_bytes, int64_t block_bytes) {
  return (data_bytes + block_bytes - 1) / block_bytes;
}

int64_t file_bytes(const FileHeader& h) {
  return kHeaderBytes + h.data_bytes + (block_count(h.data_bytes, h.block_bytes) + 1) * 8;
}

// ---- manifest ------------------------------------------------------------------------------

std::string hex64(uint64_t v) {
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(v));
  return buf;
}

namespace {

json options_json(const OptimizerOptions& o) {
  return {{"optimizer", optimizer_name(o.kind)},
          {"lr", o.lr},
          {"beta1", o.beta1},
          {"beta2", o.beta2},
          {"eps", o.eps},
          {"weight_decay", o.weight_decay},
          {"momentum", o.momentum},
          {"nesterov", o.nesterov},
          {"ns_steps", o.ns_steps},
          {"ns_bf16", o.ns_bf16},
          {"match_rms_adamw", o.match_rms_adamw}};
}

// The manifest's checksum covers its canonical dump without the "checksum" key.
uint64_t checksum_of(json m) {
  m.erase("checksum");
  const std::string s = m.dump();
  return offload::xxh64(s.data(), s.size(), 0);
}

// Typed access that names the field on any mismatch.
class Reader {
 public:
  explicit Reader(std::string file) : file_(std::move(file)) {}

  [[noreturn]] void bad(const std::string& path, const std::string& what) const {
    ZS_THROW(corrupted, "checkpoint: " << file_ << ": " << path << " " << what);
  }
  const json& at(const json& obj, const std::string& key, const std::string& path) const {
    if (!obj.is_object()) bad(path, "is not an object");
    auto it = obj.find(key);
    if (it == obj.end()) bad(path + "." + key, "is missing");
    return *it;
  }
  int64_t integer(const json& obj, const std::string& key, const std::string& path, int64_t lo,
                  int64_t hi) const {
    const json& v = at(obj, key, path);
    if (!v.is_number_integer()) bad(path + "." + key, "is not an integer");
    const int64_t x = v.is_number_unsigned() && v.get<uint64_t>() > uint64_t(INT64_MAX)
                          ? INT64_MAX
                          : v.get<int64_t>();
    if (x < lo || x > hi)
      bad(path + "." + key, "= " + std::to_string(x) + " is out of range [" + std::to_string(lo) +
                                ", " + std::to_string(hi) + "]");
    return x;
  }
  double number(const json& obj, const std::string& key, const std::string& path) const {
    const json& v = at(obj, key, path);
    if (!v.is_number()) bad(path + "." + key, "is not a number");
    const double x = v.get<double>();
    if (!std::isfinite(x)) bad(path + "." + key, "is not finite");
    return x;
  }
  float f32(const json& obj, const std::string& key, const std::string& path) const {
    const double x = number(obj, key, path);
    if (std::fabs(x) > std::numeric_limits<float>::max())
      bad(path + "." + key, "is out of the range of f32");
    return float(x);
  }
  bool boolean(const json& obj, const std::string& key, const std::string& path) const {
    const json& v = at(obj, key, path);
    if (!v.is_boolean()) bad(path + "." + key, "is not a boolean");
    return v.get<bool>();
  }
  std::string string(const json& obj, const std::string& key, const std::string& path) const {
    const json& v = at(obj, key, path);
    if (!v.is_string()) bad(path + "." + key, "is not a string");
    return v.get<std::string>();
  }
  const json& array(const json& obj, const std::string& key, const std::string& path,
                    size_t max) const {
    const json& v = at(obj, key, path);
    if (!v.is_array()) bad(path + "." + key, "is not an array");
    if (v.size() > max) bad(path + "." + key, "has too many entries");
    return v;
  }

 private:
  std::string file_;
};

OptimizerKind parse_kind(const Reader& r, const std::string& name, const std::string& path) {
  for (OptimizerKind k : {OptimizerKind::adam, OptimizerKind::adamw, OptimizerKind::sgd,
                          OptimizerKind::lion, OptimizerKind::muon})
    if (name == optimizer_name(k)) return k;
  r.bad(path, "names no optimizer ('" + name + "')");
}

}  // namespace

Range owned_by(const ShardInfo& s, int r) {
  const int64_t b = std::min(int64_t(r) * s.shard_numel, s.numel);
  const int64_t e = std::min(int64_t(r + 1) * s.shard_numel, s.numel);
  return {0, b, e, 0};
}

FileHeader expected_header(const Manifest& m, int rank, int state) {
  const Encoding e = encoding_of(m, state);
  int64_t bytes = 0;
  for (const Range& rg : m.ranges[size_t(rank)]) bytes += encoded_bytes(e, rg.end - rg.begin);
  return {m.save_id, rank, state, m.block_bytes, bytes};
}

std::vector<int64_t> range_bytes(const Manifest& m, int rank, int state) {
  const Encoding e = encoding_of(m, state);
  std::vector<int64_t> at;
  int64_t bytes = 0;
  for (const Range& rg : m.ranges[size_t(rank)]) {
    at.push_back(bytes);
    bytes += encoded_bytes(e, rg.end - rg.begin);
  }
  return at;
}

std::string manifest_text(const Manifest& m) {
  json units = json::array();
  for (const UnitInfo& u : m.units) {
    json params = json::array();
    int64_t offset = 0;  // of the parameter in the unit's values
    for (const ParamInfo& p : u.params) {
      json entry = {{"name", p.name}, {"shape", p.shape}, {"offset", offset}};
      if (p.group >= 0) entry["group"] = p.group;
      params.push_back(std::move(entry));
      offset += shape_numel(p.shape);
    }
    units.push_back({{"name", u.name}, {"numel", u.numel}, {"params", params}});
  }
  json groups = json::array();
  for (const OptimizerOptions& g : m.groups) groups.push_back(options_json(g));
  json ranks = json::array();
  for (const auto& rr : m.ranges) {
    json list = json::array();
    for (const Range& r : rr) list.push_back({r.unit, r.begin, r.end, r.offset});
    ranks.push_back(list);
  }
  json j = {{"format", kFormat},
            {"schema", kSchema},
            {"tag", m.tag},
            {"save_id", hex64(m.save_id)},
            {"world_size", m.world_size},
            {"stage", m.stage},
            {"dtype", m.dtype},
            {"optimizer", m.optimizer},
            {"step", m.step},
            {"loss_scaler",
             {{"scale", m.scaler.scale},
              {"hysteresis_left", m.scaler.hysteresis_left},
              {"iteration", m.scaler.iteration},
              {"last_overflow", m.scaler.last_overflow}}},
            {"groups", groups},
            {"states", m.states},
            {"state_format", state_format_name(m.state_format)},
            {"state_block", m.state_block},
            {"block_bytes", m.block_bytes},
            {"units", units},
            {"ranges", ranks}};
  j["checksum"] = hex64(checksum_of(j));
  return j.dump(1) + "\n";
}

Manifest parse_manifest(std::string_view text, const std::string& file) {
  json j;
  try {
    j = json::parse(text);
  } catch (const std::exception& e) {
    ZS_THROW(corrupted, "checkpoint: " << file << " is not valid JSON: " << e.what());
  }
  Reader r(file);
  if (!j.is_object()) r.bad("the manifest", "is not a JSON object");
  if (r.string(j, "format", "") != kFormat)
    ZS_THROW(invalid_argument, "checkpoint: " << file << " is not a zeroshard checkpoint manifest");
  const int64_t schema = r.integer(j, "schema", "", 0, INT32_MAX);
  if (schema < kOldestSchema || schema > kSchema)
    ZS_THROW(invalid_argument, "checkpoint: " << file << " has schema " << schema
                                              << "; this zeroshard reads schemas " << kOldestSchema
                                              << " to " << kSchema);
  Manifest m;
  m.tag = r.string(j, "tag", "");
  const std::string id = r.string(j, "save_id", "");
  if (id.size() != 16 || id.find_first_not_of("0123456789abcdef") != std::string::npos)
    r.bad("save_id", "is not 16 hex digits");
  m.save_id = std::stoull(id, nullptr, 16);
  m.world_size = int(r.integer(j, "world_size", "", 1, 1 << 24));
  m.stage = int(r.integer(j, "stage", "", 0, 3));
  m.dtype = r.string(j, "dtype", "");
  m.optimizer = r.string(j, "optimizer", "");
  parse_kind(r, m.optimizer, "optimizer");
  m.step = r.integer(j, "step", "", 0, INT64_MAX);
  const json& ls = r.at(j, "loss_scaler", "");
  m.scaler.scale = r.f32(ls, "scale", "loss_scaler");
  if (!(m.scaler.scale > 0)) r.bad("loss_scaler.scale", "must be > 0");
  m.scaler.hysteresis_left = int(r.integer(ls, "hysteresis_left", "loss_scaler", 0, INT32_MAX));
  m.scaler.iteration = r.integer(ls, "iteration", "loss_scaler", 0, INT64_MAX);
  m.scaler.last_overflow = r.integer(ls, "last_overflow", "loss_scaler", -1, INT64_MAX);
  const json& groups = r.array(j, "groups", "", 1 << 20);
  if (groups.empty()) r.bad("groups", "is empty");
  for (size_t g = 0; g < groups.size(); ++g) {
    const std::string p = "groups[" + std::to_string(g) + "]";
    OptimizerOptions o;
    o.kind = parse_kind(r, r.string(groups[g], "optimizer", p), p + ".optimizer");
    o.lr = r.f32(groups[g], "lr", p);
    o.beta1 = r.f32(groups[g], "beta1", p);
    o.beta2 = r.f32(groups[g], "beta2", p);
    o.eps = r.f32(groups[g], "eps", p);
    o.weight_decay = r.f32(groups[g], "weight_decay", p);
    o.momentum = r.f32(groups[g], "momentum", p);
    o.nesterov = r.boolean(groups[g], "nesterov", p);
    // Muon's settings (absent from checkpoints written before Muon: their defaults).
    if (groups[g].contains("ns_steps"))
      o.ns_steps = int(r.integer(groups[g], "ns_steps", p, 1, 100));
    if (groups[g].contains("ns_bf16")) o.ns_bf16 = r.boolean(groups[g], "ns_bf16", p);
    if (groups[g].contains("match_rms_adamw"))
      o.match_rms_adamw = r.boolean(groups[g], "match_rms_adamw", p);
    m.groups.push_back(o);
  }
  const json& states = r.array(j, "states", "", state_names().size());
  for (size_t s = 0; s < states.size(); ++s) {
    if (!states[s].is_string()) r.bad("states[" + std::to_string(s) + "]", "is not a string");
    const std::string name = states[s].get<std::string>();
    bool known = false;
    for (const StateName& sn : state_names()) known |= name == sn.name;
    if (!known) r.bad("states[" + std::to_string(s) + "]", "names no state ('" + name + "')");
    m.states.push_back(name);
  }
  if (schema >= 3) {
    const std::string name = r.string(j, "state_format", "");
    bool known = false;
    for (StateFormat f : {StateFormat::f32, StateFormat::bf16, StateFormat::q8})
      if (name == state_format_name(f)) m.state_format = f, known = true;
    if (!known) r.bad("state_format", "names no format ('" + name + "')");
    m.state_block = r.integer(j, "state_block", "", 0, int64_t(1) << 30);
    if (m.state_format == StateFormat::q8 && m.state_block < 1) r.bad("state_block", "is 0");
    m.q8_dynamic_map = schema == 3 && m.state_format == StateFormat::q8;
  }
  m.block_bytes = r.integer(j, "block_bytes", "", 4096, int64_t(1) << 30);
  if (m.block_bytes % 4096) r.bad("block_bytes", "is not a multiple of 4096");
  const json& units = r.array(j, "units", "", 1 << 24);
  for (size_t u = 0; u < units.size(); ++u) {
    const std::string p = "units[" + std::to_string(u) + "]";
    UnitInfo info;
    info.name = r.string(units[u], "name", p);
    info.numel = r.integer(units[u], "numel", p, 0, int64_t(1) << 48);
    const json& params = r.array(units[u], "params", p, 1 << 24);
    int64_t total = 0;
    for (size_t i = 0; i < params.size(); ++i) {
      const std::string pp = p + ".params[" + std::to_string(i) + "]";
      ParamInfo pi;
      pi.name = r.string(params[i], "name", pp);
      const json& shape = r.array(params[i], "shape", pp, 16);
      int64_t n = 1;
      for (size_t d = 0; d < shape.size(); ++d) {
        if (!shape[d].is_number_integer() || shape[d].get<int64_t>() < 0 ||
            shape[d].get<int64_t>() > (int64_t(1) << 48))
          r.bad(pp + ".shape[" + std::to_string(d) + "]", "is not a dimension");
        const int64_t dim = shape[d].get<int64_t>();
        if (dim != 0 && n > (int64_t(1) << 48) / dim)
          r.bad(pp + ".shape", "has more than 2^48 elements");
        n *= dim;
        pi.shape.push_back(dim);
      }
      if (params[i].is_object() && params[i].contains("group"))
        pi.group = int(r.integer(params[i], "group", pp, 0, int64_t(1) << 20));
      if (r.integer(params[i], "offset", pp, 0, int64_t(1) << 48) != total)
        r.bad(pp + ".offset", "is not where the parameters before it end");
      total += n;
      if (total > (int64_t(1) << 48)) r.bad(p, "has more than 2^48 elements");
      info.params.push_back(std::move(pi));
    }
    if (total != info.numel) r.bad(p + ".numel", "is not the sum of its parameters' sizes");
    m.units.push_back(std::move(info));
  }
  // Every unit's values are covered exactly once by the ranks' ranges, and each rank's ranges
  // lie end to end in its files.
  const json& ranks = r.array(j, "ranges", "", size_t(m.world_size));
  if (ranks.size() != size_t(m.world_size)) r.bad("ranges", "does not have one list per rank");
  std::vector<std::vector<std::pair<int64_t, int64_t>>> cover(m.units.size());
  for (size_t k = 0; k < ranks.size(); ++k) {
    const std::string p = "ranges[" + std::to_string(k) + "]";
    if (!ranks[k].is_array() || ranks[k].size() > m.units.size())
      r.bad(p, "is not a list of ranges");
    std::vector<Range> list;
    int64_t next = 0;
    for (size_t i = 0; i < ranks[k].size(); ++i) {
      const json& e = ranks[k][i];
      const std::string pe = p + "[" + std::to_string(i) + "]";
      if (!e.is_array() || e.size() != 4) r.bad(pe, "is not [unit, begin, end, offset]");
      for (const json& x : e)
        if (!x.is_number_integer() || x.get<int64_t>() < 0) r.bad(pe, "has a non-integer entry");
      Range rg{int(std::min<int64_t>(e[0].get<int64_t>(), INT32_MAX)), e[1].get<int64_t>(),
               e[2].get<int64_t>(), e[3].get<int64_t>()};
      if (size_t(rg.unit) >= m.units.size() || rg.begin >= rg.end ||
          rg.end > m.units[size_t(rg.unit)].numel || rg.offset != next)
        r.bad(pe, "is not a range of a unit, end to end with the one before it");
      // A range of 8-bit moments is whole blocks of its unit (a shard starts on a block).
      if (m.state_format == StateFormat::q8 && rg.begin % m.state_block != 0)
        r.bad(pe, "does not start on a block of state_block values");
      next += rg.end - rg.begin;  // each term <= 2^48: no overflow before the check below
      if (next > (int64_t(1) << 48)) r.bad(p, "holds more than 2^48 values");
      cover[size_t(rg.unit)].emplace_back(rg.begin, rg.end);
      list.push_back(rg);
    }
    m.ranges.push_back(std::move(list));
  }
  for (size_t u = 0; u < cover.size(); ++u) {
    auto& c = cover[u];
    std::sort(c.begin(), c.end());
    int64_t at = 0;
    for (auto [b, e] : c) {
      if (b != at) r.bad("ranges", "do not cover unit " + std::to_string(u) + " exactly once");
      at = e;
    }
    if (at != m.units[u].numel)
      r.bad("ranges", "do not cover unit " + std::to_string(u) + " exactly once");
  }
  // Last, so that a manifest edited by hand is told what is wrong with it first.
  if (r.string(j, "checksum", "") != hex64(checksum_of(j)))
    ZS_THROW(corrupted, "checkpoint: " << file
                                       << ": checksum mismatch (the manifest was changed "
                                          "or damaged after it was written)");
  return m;
}

// The whole of a small regular file, refused above `limit` bytes (kept out of messages then).
// Empty optional: the file does not exist.
std::optional<std::string> read_small_file(const std::filesystem::path& file, uintmax_t limit) {
  UniqueFd fd(open_regular(file, O_RDONLY));
  if (!fd) return std::nullopt;
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0) io_failure(file, "inspecting", errno);
  if (uintmax_t(st.st_size) > limit)
    ZS_THROW(corrupted, "checkpoint: " << file << " is " << st.st_size << " bytes, over the "
                                       << limit << " it can be");
  std::string text(size_t(st.st_size), '\0');
  pread_all(fd.get(), text.data(), text.size(), 0, file, "end");
  return text;
}

std::filesystem::path resolve(const std::filesystem::path& path) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (fs::exists(path / "manifest.json", ec)) return path;
  // `latest` holds a tag name (at most 200 bytes) and a newline, as save() writes it.
  const std::optional<std::string> latest = read_small_file(path / "latest", 256);
  if (!latest) {
    // The tags it does hold (complete ones: a manifest), so that the user can name one.
    std::vector<std::string> tags;
    if (fs::is_directory(path, ec))
      for (const fs::directory_entry& d : fs::directory_iterator(path, ec))
        if (fs::exists(d.path() / "manifest.json", ec)) tags.push_back(d.path().filename());
    std::sort(tags.begin(), tags.end());
    std::string held;
    for (size_t i = 0; i < tags.size() && i < 10; ++i) held += (i ? ", " : "") + tags[i];
    if (tags.size() > 10) held += ", ... (" + std::to_string(tags.size()) + " in all)";
    ZS_THROW(invalid_argument,
             "checkpoint: " << path << " holds neither manifest.json (a tag) nor latest (a root "
                            << "of tags): "
                            << (tags.empty()
                                    ? std::string("it holds no tag either, so no save "
                                                  "completed there")
                                    : "load one of the tags it holds by its directory: " + held));
  }
  const std::string& text = *latest;
  // Exactly "<tag>\n", as save() writes it.
  const std::string tag =
      text.size() > 1 && text.back() == '\n' ? text.substr(0, text.size() - 1) : std::string();
  try {
    check_tag(tag);
  } catch (const Error&) {
    ZS_THROW(corrupted, "checkpoint: " << (path / "latest") << " names no tag ('" << text << "')");
  }
  if (!fs::exists(path / tag / "manifest.json", ec))
    ZS_THROW(corrupted, "checkpoint: " << (path / "latest") << " names tag '" << tag
                                       << "', which has no manifest.json");
  return path / tag;
}

Manifest read_manifest(const std::filesystem::path& tag_dir) {
  const std::filesystem::path file = tag_dir / "manifest.json";
  const std::optional<std::string> text = read_small_file(file, uintmax_t(1) << 30);
  if (!text) ZS_THROW(invalid_argument, "checkpoint: cannot open " << file << ": no such file");
  return parse_manifest(*text, file.string());
}

}  // namespace zeroshard::ckpt
