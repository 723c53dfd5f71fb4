// describe_checkpoint() and verify_checkpoint() (zeroshard/checkpoint.hpp).
#include <sstream>

#include "src/checkpoint/data_file.hpp"
#include "src/checkpoint/format.hpp"
#include "src/checkpoint/module_file.hpp"
#include "zeroshard/checkpoint.hpp"

namespace zeroshard {

using namespace ckpt;

namespace {

// A manifest's state name (parse_manifest() checked it) as an index into state_names().
int state_index(const std::string& name) {
  int s = 0;
  while (state_names()[size_t(s)].name != name) ++s;
  return s;
}

}  // namespace

std::string describe_checkpoint(const std::filesystem::path& path) {
  const std::filesystem::path dir = resolve(path);
  const Manifest m = read_manifest(dir);
  std::ostringstream os;
  os << "checkpoint " << dir.string() << "\n"
     << "  tag          " << m.tag << "\n"
     << "  step         " << m.step << "\n"
     << "  world size   " << m.world_size << " (stage " << m.stage << ", " << m.dtype << ")\n"
     << "  optimizer    " << m.optimizer << " (states:";
  for (const std::string& s : m.states) os << " " << s;
  os << "; moments " << state_format_name(m.state_format);
  if (m.state_format == StateFormat::q8) os << " in blocks of " << m.state_block;
  if (m.q8_dynamic_map) os << " (codes of the dynamic map: schema 3)";
  os << ")\n"
     << "  loss scaler  scale " << m.scaler.scale << ", hysteresis left "
     << m.scaler.hysteresis_left << ", iteration " << m.scaler.iteration << ", last overflow "
     << m.scaler.last_overflow << "\n";
  for (size_t g = 0; g < m.groups.size(); ++g) {
    const OptimizerOptions& o = m.groups[g];
    os << "  group " << g << "      lr " << o.lr << ", betas (" << o.beta1 << ", " << o.beta2
       << "), eps " << o.eps << ", weight_decay " << o.weight_decay << ", momentum " << o.momentum
       << (o.nesterov ? " (nesterov)" : "") << "\n";
  }
  int64_t total = 0;
  for (const UnitInfo& u : m.units) total += u.numel;
  os << "  units        " << m.units.size() << ", " << total << " parameters\n";
  for (size_t u = 0; u < m.units.size(); ++u) {
    os << "    " << u << "  " << m.units[u].name << "  (" << m.units[u].numel << ")\n";
    for (const ParamInfo& p : m.units[u].params)
      os << "         " << p.name << " " << shape_string(p.shape) << "\n";
  }
  return os.str();
}

int64_t verify_checkpoint(const std::filesystem::path& path,
                          const std::function<void(int64_t, int64_t)>& progress) {
  const std::filesystem::path dir = resolve(path);
  const Manifest m = read_manifest(dir);
  int64_t total = 0;
  for (const std::string& state : m.states)
    for (int r = 0; r < m.world_size; ++r)
      total += expected_header(m, r, state_index(state)).data_bytes;
  int64_t done = 0;
  for (const std::string& state : m.states) {
    const int s = state_index(state);
    for (int r = 0; r < m.world_size; ++r) {
      DataFileReader f(dir / data_file_name(r, state.c_str()), expected_header(m, r, s));
      f.verify_all([&](int64_t n) {
        done += n;
        if (progress) progress(done, total);
      });
    }
  }
  read_module_file(dir, m.save_id);  // the module's tensors, their checksum
  return done;
}

}  // namespace zeroshard
