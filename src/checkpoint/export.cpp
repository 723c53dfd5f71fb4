// export_checkpoint() (zeroshard/checkpoint.hpp): a checkpoint's f32 master weights (under
// every alias too), its module tensors and its optimizer state as safetensors files, the model's
// sharded above a size with Hugging Face's index, streamed unit by unit and tensor by tensor
// (memory: one unit's values, or one module tensor). Also read_module_state().
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>

#include "base/check.hpp"
#include "base/unique_fd.hpp"
#include "src/checkpoint/data_file.hpp"
#include "src/checkpoint/file_io.hpp"
#include "src/checkpoint/format.hpp"
#include "src/checkpoint/module_file.hpp"
#include "src/checkpoint/safetensors.hpp"
#include "zeroshard/checkpoint.hpp"

namespace zeroshard {

using namespace ckpt;
namespace fs = std::filesystem;
using nlohmann::json;

namespace {

// torch.optim's names for the optimizer's states.
const char* torch_state_name(const std::string& optimizer, const std::string& state) {
  if (optimizer == "sgd") return "momentum_buffer";
  return state == "state0" ? "exp_avg" : "exp_avg_sq";
}

// One tensor of the exported model: a trained parameter's master weights (or an alias of
// them), read from unit `unit` at `offset`, or a module tensor (module.safetensors).
struct Entry {
  std::string name, dtype;
  std::vector<int64_t> shape;
  int64_t bytes = 0;
  int unit = -1;  // -1: a module tensor
  int64_t offset = 0, numel = 0;
  const StTensor* module = nullptr;
  int shard = 0;
};

std::string shard_name(int i, int n) {
  char s[64];
  std::snprintf(s, sizeof s, "model-%05d-of-%05d.safetensors", i + 1, n);
  return s;
}

// model.safetensors, or above `max_shard_bytes` the shards model-0000i-of-0000n.safetensors and
// model.safetensors.index.json, under temporary names until rename(). Writers open and finish in
// order as the entries reach them.
class ModelFiles {
 public:
  ModelFiles(const fs::path& dir, std::vector<Entry>& entries, int64_t max_shard_bytes,
             std::map<std::string, std::string> meta)
      : dir_(dir), entries_(entries), meta_(std::move(meta)) {
    int64_t in_shard = 0;
    for (Entry& e : entries_) {
      if (in_shard > 0 && max_shard_bytes > 0 && in_shard + e.bytes > max_shard_bytes) {
        ++shards_;
        in_shard = 0;
      }
      e.shard = shards_;
      in_shard += e.bytes;
      total_ += e.bytes;
    }
    ++shards_;
  }
  int64_t total_bytes() const { return total_; }
  std::vector<std::string> final_names() const {
    std::vector<std::string> n;
    if (shards_ == 1) return {"model.safetensors"};
    for (int i = 0; i < shards_; ++i) n.push_back(shard_name(i, shards_));
    n.push_back("model.safetensors.index.json");
    return n;
  }
  // The next entry's bytes (entries come in order).
  void append(const Entry& e, const void* data) {
    if (!writer_ || e.shard != open_) open(e.shard);
    writer_->append_bytes(data, e.bytes);
  }
  // Finishes the last shard and writes the index.
  void finish() {
    if (!writer_) open(0);  // a model of no tensors: one empty file
    writer_->finish();
    writer_.reset();
    if (shards_ == 1) return;
    json map = json::object();
    for (const Entry& e : entries_) map[e.name] = shard_name(e.shard, shards_);
    json meta = json::object();
    for (const auto& [k, v] : meta_) meta[k] = v;
    meta["total_size"] = total_;
    const std::string text = json{{"metadata", meta}, {"weight_map", map}}.dump(2) + "\n";
    const fs::path tmp = dir_ / "model.safetensors.index.json.tmp";
    UniqueFd fd(::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
    if (!fd) io_failure(tmp, "creating", errno);
    pwrite_all(fd.get(), text.data(), text.size(), 0, tmp);
    fsync_fd(fd.get(), tmp);
  }
  // Every file takes its name; the index (or the single file) last. Then the files of an
  // earlier export of the other layout go: a loader finds model.safetensors before an index.
  void rename() {
    for (const std::string& n : final_names()) rename_path(dir_ / (n + ".tmp"), dir_ / n);
    const std::vector<std::string> now = final_names();
    std::error_code ec;
    for (const auto& f : fs::directory_iterator(dir_, ec)) {
      const std::string n = f.path().filename().string();
      const bool shard = n.rfind("model-", 0) == 0 && n.find("-of-") != std::string::npos &&
                         n.size() > 12 && n.compare(n.size() - 12, 12, ".safetensors") == 0;
      const bool layout = shard || n == "model.safetensors" || n == "model.safetensors.index.json";
      if (layout && std::find(now.begin(), now.end(), n) == now.end()) fs::remove(f.path(), ec);
    }
  }
  void remove_temporaries() {
    std::error_code ec;
    for (const std::string& n : final_names()) fs::remove(dir_ / (n + ".tmp"), ec);
  }

 private:
  void open(int shard) {
    while (open_ < shard || !writer_) {
      if (writer_) {
        writer_->finish();
        ++open_;
      }
      std::vector<std::string> names, dtypes;
      std::vector<std::vector<int64_t>> shapes;
      for (const Entry& e : entries_)
        if (e.shard == open_) {
          names.push_back(e.name);
          dtypes.push_back(e.dtype);
          shapes.push_back(e.shape);
        }
      writer_ = std::make_unique<StWriter>(dir_ / (final_names()[size_t(open_)] + ".tmp"), names,
                                           shapes, meta_, dtypes);
    }
  }

  fs::path dir_;
  std::vector<Entry>& entries_;
  std::map<std::string, std::string> meta_;
  int shards_ = 0, open_ = 0;
  int64_t total_ = 0;
  std::unique_ptr<StWriter> writer_;
};

}  // namespace

ModuleState read_module_state(const fs::path& path) {
  const fs::path dir = resolve(path);
  return read_module_file(dir, read_manifest(dir).save_id);
}

void export_checkpoint(const fs::path& path, const fs::path& out_dir,
                       const std::function<void(int64_t, int64_t)>& progress,
                       int64_t max_shard_bytes) {
  if (max_shard_bytes < 0)
    ZS_THROW(invalid_argument, "export: a shard size limit of " << max_shard_bytes << " bytes");
  const fs::path dir = resolve(path);
  // A saved tag is never modified (and the export would be pruned with it).
  const fs::path tag = fs::weakly_canonical(dir), out = fs::weakly_canonical(out_dir);
  const auto [t, o] = std::mismatch(tag.begin(), tag.end(), out.begin(), out.end());
  if (t == tag.end())
    ZS_THROW(invalid_argument, "export: " << out_dir << " is inside the checkpoint's tag directory "
                                          << dir
                                          << ", which a saved checkpoint never changes; "
                                             "export to a directory of its own");
  const Manifest m = read_manifest(dir);
  UnitReader src(dir, m);
  const std::vector<std::string> names = tensor_names(m.units);
  std::vector<std::string> states;  // the optimizer's, by their index in state_names()
  std::vector<int> state_index;
  for (size_t s = 1; s < state_names().size(); ++s)
    for (const std::string& have : m.states)
      if (have == state_names()[s].name) {
        states.push_back(have);
        state_index.push_back(int(s));
      }
  // The module file: its aliases join the parameters they name, its tensors come last, in
  // file order (the order its checksum chains them in).
  std::unique_ptr<ModuleReader> module;
  std::multimap<std::string, std::string> aliases;  // target -> alias
  if (fs::exists(dir / kModuleFile)) {
    module = std::make_unique<ModuleReader>(dir / kModuleFile, m.save_id);
    for (const auto& [alias, target] : module->aliases()) aliases.emplace(target, alias);
  }
  std::vector<Entry> entries;
  std::vector<std::vector<int64_t>> shapes, opt_shapes;
  std::vector<std::string> opt_names;
  int64_t total = 0;
  size_t k = 0;
  for (size_t u = 0; u < m.units.size(); ++u) {
    const size_t first = k;
    int64_t offset = 0;
    for (const ParamInfo& p : m.units[u].params) {
      int64_t n = 1;
      for (int64_t d : p.shape) n *= d;
      shapes.push_back(p.shape);
      entries.push_back({names[k], "F32", p.shape, n * 4, int(u), offset, n, nullptr, 0});
      auto [lo, hi] = aliases.equal_range(names[k]);
      for (auto it = lo; it != hi; ++it)
        entries.push_back({it->second, "F32", p.shape, n * 4, int(u), offset, n, nullptr, 0});
      offset += n;
      ++k;
    }
    for (const std::string& s : states)
      for (size_t i = first; i < k; ++i) {
        opt_names.push_back(names[i] + "." + torch_state_name(m.optimizer, s));
        opt_shapes.push_back(shapes[i]);
      }
    total += m.units[u].numel * int64_t(1 + states.size()) * 4;
  }
  if (module)
    for (const StTensor* x : module->tensors()) {
      entries.push_back({x->name, x->dtype, x->shape, x->end - x->begin, -1, 0, 0, x, 0});
      total += x->end - x->begin;
    }
  const std::map<std::string, std::string> meta = {{"format", "zeroshard-export"},
                                                   {"tag", m.tag},
                                                   {"step", std::to_string(m.step)},
                                                   {"optimizer", m.optimizer}};
  make_directories(out_dir);
  ModelFiles model(out_dir, entries, max_shard_bytes, meta);
  const fs::path opt_tmp = out_dir / "optimizer.safetensors.tmp";
  try {
    std::unique_ptr<StWriter> opt;
    if (!states.empty()) opt = std::make_unique<StWriter>(opt_tmp, opt_names, opt_shapes, meta);
    int64_t done = 0;
    std::vector<float> v;
    size_t next = 0;  // the next entry
    for (size_t u = 0; u < m.units.size(); ++u) {
      const int64_t n = m.units[u].numel;
      v.resize(size_t(n));
      src.read(0, int(u), 0, n, v.data());  // state_names()[0] is the master
      for (; next < entries.size() && entries[next].unit == int(u); ++next)
        model.append(entries[next], v.data() + entries[next].offset);
      for (int s : state_index) {
        src.read(s, int(u), 0, n, v.data());
        opt->append(v.data(), n);
      }
      done += n * int64_t(1 + states.size()) * 4;
      if (progress) progress(done, total);
    }
    std::vector<char> bytes;
    for (; next < entries.size(); ++next) {
      bytes.resize(size_t(entries[next].bytes));
      module->read(*entries[next].module, bytes.data());
      model.append(entries[next], bytes.data());
      done += entries[next].bytes;
      if (progress) progress(done, total);
    }
    if (module) module->finish();
    // Every file complete and durable before any takes its name.
    model.finish();
    if (opt) opt->finish();
    // The optimizer's file first: the model's, which loaders look for, appear last.
    if (opt) rename_path(opt_tmp, out_dir / "optimizer.safetensors");
    try {
      model.rename();
    } catch (...) {
      std::error_code ec;
      if (opt) fs::remove(out_dir / "optimizer.safetensors", ec);
      for (const std::string& f : model.final_names()) fs::remove(out_dir / f, ec);
      throw;
    }
  } catch (...) {
    // A failed export (a full disk, a damaged block) leaves no partial or lone file behind.
    std::error_code ec;
    model.remove_temporaries();
    fs::remove(opt_tmp, ec);
    throw;
  }
  fsync_path(out_dir);
}

}  // namespace zeroshard
