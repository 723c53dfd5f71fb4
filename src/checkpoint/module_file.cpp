// module.safetensors (module_file.hpp).
#include "src/checkpoint/module_file.hpp"

#include <algorithm>
#include <nlohmann/json.hpp>
#include <set>

#include "base/check.hpp"
#include "base/checksum.hpp"
#include "src/checkpoint/format.hpp"
#include "src/checkpoint/safetensors.hpp"

namespace zeroshard::ckpt {

namespace fs = std::filesystem;
using nlohmann::json;

void write_module_file(const fs::path& dir, const ModuleState& module, uint64_t save_id,
                       const std::vector<std::string>& trained) {
  const std::set<std::string> params(trained.begin(), trained.end());
  std::set<std::string> taken = params;
  std::vector<std::string> names, dtypes;
  std::vector<std::vector<int64_t>> shapes;
  uint64_t sum = 0;
  for (const ModuleTensor& t : module.tensors) {
    const std::string at = "save: module tensor '" + t.name + "'";
    if (t.name.empty()) ZS_THROW(invalid_argument, "save: a module tensor has no name");
    if (params.count(t.name))
      ZS_THROW(invalid_argument, at << " is named as a parameter the engine trains");
    if (!taken.insert(t.name).second) ZS_THROW(invalid_argument, at << " is given twice");
    const int64_t width = dtype_bytes(t.dtype);
    if (width == 0)
      ZS_THROW(invalid_argument, at << ": dtype '" << t.dtype
                                    << "' is none of F64, F32, BF16, F16, I64, I32, I16, I8, "
                                       "U64, U32, U16, U8, BOOL");
    int64_t n = 1;
    for (int64_t d : t.shape) {
      if (d < 0) ZS_THROW(invalid_argument, at << ": a negative dimension");
      n *= d;
    }
    if (int64_t(t.bytes.size()) != n * width)
      ZS_THROW(invalid_argument,
               at << ": " << t.bytes.size() << " bytes for " << n << " " << t.dtype << " values");
    names.push_back(t.name);
    dtypes.push_back(t.dtype);
    shapes.push_back(t.shape);
    sum = offload::xxh64(t.bytes.data(), t.bytes.size(), sum);
  }
  json aliases = json::object();
  for (const auto& [name, target] : module.aliases) {
    if (!params.count(target))
      ZS_THROW(invalid_argument, "save: alias '" << name << "' names '" << target
                                                 << "', which is no parameter the engine trains");
    if (!taken.insert(name).second)
      ZS_THROW(invalid_argument, "save: alias '" << name << "' is a name already taken");
    aliases[name] = target;
  }
  StWriter w(dir / kModuleFile, names, shapes,
             {{"format", "zeroshard-module"},
              {"save_id", hex64(save_id)},
              {"xxh64", hex64(sum)},
              {"aliases", aliases.dump()}},
             dtypes);
  for (const ModuleTensor& t : module.tensors)
    w.append_bytes(t.bytes.data(), int64_t(t.bytes.size()));
  w.finish();
}

ModuleReader::ModuleReader(fs::path path, uint64_t save_id) : path_(std::move(path)), r_(path_) {
  const auto& meta = r_.metadata();
  auto field = [&](const char* key) -> std::string {
    auto it = meta.find(key);
    if (it == meta.end())
      ZS_THROW(corrupted, "checkpoint: " << path_ << ": its metadata has no '" << key << "'");
    return it->second;
  };
  if (field("format") != "zeroshard-module")
    ZS_THROW(corrupted, "checkpoint: " << path_ << ": not a zeroshard module file");
  if (field("save_id") != hex64(save_id))
    ZS_THROW(corrupted, "checkpoint: " << path_ << " belongs to another save (save id "
                                       << field("save_id") << ", the manifest's " << hex64(save_id)
                                       << ")");
  field("xxh64");
  json aliases;
  try {
    aliases = json::parse(field("aliases"));
  } catch (const std::exception&) {
  }
  if (!aliases.is_object())
    ZS_THROW(corrupted, "checkpoint: " << path_ << ": its aliases are not a JSON object");
  for (auto it = aliases.begin(); it != aliases.end(); ++it) {
    if (!it.value().is_string())
      ZS_THROW(corrupted,
               "checkpoint: " << path_ << ": alias '" << it.key() << "' names no string");
    aliases_.emplace_back(it.key(), it.value().get<std::string>());
  }
  for (const StTensor& t : r_.tensors()) order_.push_back(&t);
  std::sort(order_.begin(), order_.end(),
            [](const StTensor* a, const StTensor* b) { return a->begin < b->begin; });
}

void ModuleReader::read(const StTensor& t, void* out) {
  ZS_CHECK(next_ < order_.size() && order_[next_] == &t);
  ++next_;
  r_.read_bytes(t, out);
  sum_ = offload::xxh64(out, size_t(t.end - t.begin), sum_);
}

void ModuleReader::finish() const {
  ZS_CHECK(next_ == order_.size());
  if (hex64(sum_) != r_.metadata().at("xxh64"))
    ZS_THROW(corrupted, "checkpoint: " << path_ << " fails its checksum: the file is damaged");
}

ModuleState read_module_file(const fs::path& dir, uint64_t save_id) {
  const fs::path path = dir / kModuleFile;
  if (!fs::exists(path)) return {};
  ModuleReader r(path, save_id);
  ModuleState out;
  out.aliases = r.aliases();
  for (const StTensor* t : r.tensors()) {
    ModuleTensor m{t->name, t->dtype, t->shape, std::vector<char>(size_t(t->end - t->begin))};
    r.read(*t, m.bytes.data());
    out.tensors.push_back(std::move(m));
  }
  r.finish();
  return out;
}

}  // namespace zeroshard::ckpt
