// Engine::load_safetensors: start from pretrained weights. Each rank reads, from the file, the
// range of each unit its shard holds (converted to f32) and makes it the master weights; the
// optimizer's moments and step are left as they are. Every name, shape and dtype is checked,
// and every shard read, before any state changes.
#include "base/check.hpp"
#include "src/checkpoint/collective.hpp"
#include "src/checkpoint/safetensors.hpp"
#include "src/engine_impl.hpp"

namespace zeroshard {

using namespace ckpt;

void Engine::load_safetensors(const std::filesystem::path& file) {
  const std::string at = "load_safetensors(" + file.string() + ")";
  std::vector<UnitInfo> units;
  for (int u = 0; u < num_units(); ++u) {
    UnitInfo info{unit_name(u), shard_info(u).numel, {}};
    for (const Param& p : unit_params(u)) info.params.push_back({p.name, p.shape});
    units.push_back(std::move(info));
  }
  const std::vector<std::string> names = tensor_names(units);
  std::unique_ptr<StReader> st;
  std::vector<const StTensor*> tensors;
  all_or_none(*communicator(), at + ": reading the header", [&] {
    for (int u = 0; u < num_units(); ++u)
      if (impl_->units[size_t(u)].gathered)
        ZS_THROW(invalid_argument,
                 at << ": unit '" << unit_name(u) << "' is gathered; release every unit first");
    st = std::make_unique<StReader>(file);
    size_t k = 0;
    for (const UnitInfo& u : units)
      for (const ParamInfo& p : u.params) {
        const StTensor* t = st->find(names[k]);
        if (!t)
          ZS_THROW(invalid_argument,
                   at << ": no tensor '" << names[k] << "' (unit '" << u.name << "') in the file");
        if (t->shape != p.shape)
          ZS_THROW(invalid_argument, at << ": tensor '" << names[k] << "' is "
                                        << shape_string(t->shape) << ", the model's "
                                        << shape_string(p.shape));
        if (t->dtype != "F32" && t->dtype != "BF16" && t->dtype != "F16")
          ZS_THROW(invalid_argument, at << ": tensor '" << names[k] << "' is " << t->dtype
                                        << "; weights come in F32, BF16 or F16");
        tensors.push_back(t);
        ++k;
      }
  });
  // Every shard read before any is written: an I/O error part way changes nothing (the
  // memory: this rank's f32 master shards, once).
  std::vector<std::vector<float>> shards;
  all_or_none(*communicator(), at + ": reading shards", [&] {
    size_t k = 0;
    for (int u = 0; u < num_units(); ++u) {
      const ShardInfo si = shard_info(u);
      const Range own = owned_by(si, shard_group().rank);
      const int64_t b = own.begin, e = own.end;
      std::vector<float> shard(size_t(si.shard_numel), 0.0f);
      int64_t offset = 0;  // of the parameter in the unit
      for (const ParamInfo& p : units[size_t(u)].params) {
        const int64_t n = shape_numel(p.shape);
        const int64_t lo = std::max(b, offset), hi = std::min(e, offset + n);
        if (lo < hi) st->read_f32(*tensors[k], lo - offset, hi - lo, shard.data() + (lo - b));
        offset += n;
        ++k;
      }
      shards.push_back(std::move(shard));
    }
  });
  for (int u = 0; u < num_units(); ++u) write_shard(u, StateKind::master, shards[size_t(u)]);
  commit_shards();
}

}  // namespace zeroshard
