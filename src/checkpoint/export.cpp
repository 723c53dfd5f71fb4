// export_checkpoint() (zeroshard/checkpoint.hpp): a checkpoint's f32 master weights and its
// optimizer state as safetensors files, streamed unit by unit (memory: one unit's values).
#include <algorithm>
#include <cstdio>

#include "base/check.hpp"
#include "src/checkpoint/data_file.hpp"
#include "src/checkpoint/file_io.hpp"
#include "src/checkpoint/format.hpp"
#include "src/checkpoint/safetensors.hpp"
#include "zeroshard/checkpoint.hpp"

namespace zeroshard {

using namespace ckpt;
namespace fs = std::filesystem;

namespace {

// torch.optim's names for the optimizer's states.
const char* torch_state_name(const std::string& optimizer, const std::string& state) {
  if (optimizer == "sgd") return "momentum_buffer";
  return state == "state0" ? "exp_avg" : "exp_avg_sq";
}

}  // namespace

void export_checkpoint(const fs::path& path, const fs::path& out_dir,
                       const std::function<void(int64_t, int64_t)>& progress) {
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
  std::vector<std::vector<int64_t>> shapes, opt_shapes;
  std::vector<std::string> opt_names;
  int64_t total = 0;
  size_t k = 0;
  for (const UnitInfo& u : m.units) {
    const size_t first = k;
    for (const ParamInfo& p : u.params) {
      shapes.push_back(p.shape);
      ++k;
    }
    for (const std::string& s : states)
      for (size_t i = first; i < k; ++i) {
        opt_names.push_back(names[i] + "." + torch_state_name(m.optimizer, s));
        opt_shapes.push_back(shapes[i]);
      }
    total += u.numel * int64_t(1 + states.size()) * 4;
  }
  const std::map<std::string, std::string> meta = {{"format", "zeroshard-export"},
                                                   {"tag", m.tag},
                                                   {"step", std::to_string(m.step)},
                                                   {"optimizer", m.optimizer}};
  make_directories(out_dir);
  const fs::path model_tmp = out_dir / "model.safetensors.tmp",
                 opt_tmp = out_dir / "optimizer.safetensors.tmp";
  try {
    StWriter model(model_tmp, names, shapes, meta);
    std::unique_ptr<StWriter> opt;
    if (!states.empty()) opt = std::make_unique<StWriter>(opt_tmp, opt_names, opt_shapes, meta);
    int64_t done = 0;
    std::vector<float> v;
    for (size_t u = 0; u < m.units.size(); ++u) {
      const int64_t n = m.units[u].numel;
      v.resize(size_t(n));
      src.read(0, int(u), 0, n, v.data());  // state_names()[0] is the master
      model.append(v.data(), n);
      for (int s : state_index) {
        src.read(s, int(u), 0, n, v.data());
        opt->append(v.data(), n);
      }
      done += n * int64_t(1 + states.size()) * 4;
      if (progress) progress(done, total);
    }
    // Both files complete and durable before either takes its name.
    model.finish();
    if (opt) opt->finish();
    // The optimizer's file first: model.safetensors, the one loaders look for, appears last.
    if (opt) rename_path(opt_tmp, out_dir / "optimizer.safetensors");
    try {
      rename_path(model_tmp, out_dir / "model.safetensors");
    } catch (...) {
      std::error_code ec;
      if (opt) fs::remove(out_dir / "optimizer.safetensors", ec);
      throw;
    }
  } catch (...) {
    // A failed export (a full disk) leaves no partial or lone file behind.
    std::error_code ec;
    fs::remove(model_tmp, ec);
    fs::remove(opt_tmp, ec);
    throw;
  }
  fsync_path(out_dir);
}

}  // namespace zeroshard
