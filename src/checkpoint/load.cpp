// Engine::load: reads a checkpoint at any world size and stage (format.hpp), in one pass, fail
// closed. Checked before any state changes: the manifest (schema, types, ranges), the model
// against it (naming the first parameter that differs), every data file's header and checksum
// table. Then every block this rank needs is read once, verified as it lands and applied: a
// failed load leaves the engine unchanged when those first checks fail, and otherwise (a damaged
// block, a failed read, on any rank) marked on every rank as holding no valid state, which
// step(), gather() and save() refuse until a load succeeds. Nothing trains on a half-loaded
// state, and the disk is read once, at its speed.
#include <algorithm>
#include <string>

#include "base/check.hpp"
#include "src/checkpoint/block_read.hpp"
#include "src/checkpoint/collective.hpp"
#include "src/checkpoint/data_file.hpp"
#include "src/checkpoint/encoding.hpp"
#include "src/checkpoint/format.hpp"
#include "src/engine_impl.hpp"

namespace zeroshard {

namespace fs = std::filesystem;
using namespace ckpt;

namespace {

// The manifest against this engine: same optimizer and groups, the states it needs, the same
// model unit by unit and parameter by parameter.
void check_fits(const Engine& e, const Manifest& m, const std::string& at) {
  if (m.optimizer != optimizer_name(e.config().optimizer.kind))
    ZS_THROW(invalid_argument, at << ": the checkpoint holds " << m.optimizer
                                  << " state, this engine runs "
                                  << optimizer_name(e.config().optimizer.kind));
  if (int(m.groups.size()) != e.num_groups())
    ZS_THROW(invalid_argument, at << ": the checkpoint has " << m.groups.size()
                                  << " parameter groups, this engine " << e.num_groups());

  for (const StateName& sn : state_names())
    if (e.has_state(sn.kind) &&
        std::find(m.states.begin(), m.states.end(), sn.name) == m.states.end())
      ZS_THROW(invalid_argument, at << ": the checkpoint has no " << sn.name << " state");
  if (int(m.units.size()) != e.num_units())
    ZS_THROW(invalid_argument, at << ": the model differs: the checkpoint has " << m.units.size()
                                  << " units, this engine " << e.num_units());
  for (int u = 0; u < e.num_units(); ++u) {
    const UnitInfo& got = m.units[size_t(u)];
    const std::vector<Param> want = e.unit_params(u);
    if (got.name != e.unit_name(u) || got.params.size() != want.size())
      ZS_THROW(invalid_argument, at << ": the model differs at unit " << u << ": the checkpoint "
                                    << "has '" << got.name << "' with " << got.params.size()
                                    << " parameters, this engine '" << e.unit_name(u) << "' with "
                                    << want.size());
    for (size_t i = 0; i < want.size(); ++i) {
      // The group decides the parameter's hyperparameters: another one would resume it with
      // another learning rate and decay, silently.
      if (got.params[i].group >= 0 && got.params[i].group != want[i].group &&
          got.params[i].name == want[i].name)
        ZS_THROW(invalid_argument, at << ": the checkpoint has '" << want[i].name << "' (unit '"
                                      << e.unit_name(u) << "') in parameter group "
                                      << got.params[i].group << ", this engine in group "
                                      << want[i].group);
      if (got.params[i].name != want[i].name || got.params[i].shape != want[i].shape)
        ZS_THROW(invalid_argument, at << ": the model differs at unit " << u << " ('"
                                      << e.unit_name(u) << "'), parameter " << i
                                      << ": the checkpoint has '" << got.params[i].name << "' "
                                      << shape_string(got.params[i].shape) << ", this engine '"
                                      << want[i].name << "' " << shape_string(want[i].shape));
    }
  }
}

}  // namespace

void Engine::load(const std::filesystem::path& path, const LoadOptions& options) {
  Impl& impl = *impl_;
  Communicator& comm = *communicator();
  const std::string at = "load(" + path.string() + ")";
  if (!impl.finalized) ZS_THROW(invalid_argument, at << " before finalize()");
  finish_save();

  fs::path dir;
  Manifest m;
  all_or_none(comm, at + ": reading the manifest", [&] {
    for (int u = 0; u < num_units(); ++u)
      if (impl.units[size_t(u)].gathered)
        ZS_THROW(invalid_argument, at << ": unit '" << unit_name(u)
                                      << "' is gathered; release every unit before a load");
    dir = resolve(path);
    m = read_manifest(dir);
    check_fits(*this, m, at);
    // Every group's hyperparameters as set_options() will take them, checked now: a refusal
    // after the shards were written would leave the engine half loaded.
    for (int g = 0; g < num_groups() && options.hyperparameters; ++g) {
      try {
        impl.check_options(g, m.groups[size_t(g)], "the checkpoint's hyperparameters");
      } catch (const Error& err) {
        throw Error(ErrorCode::invalid_argument, at + ": " + err.what());
      }
    }
  });

  // Every rank read the same save (another job may have replaced `latest` in between).
  double ids[4] = {double(m.save_id >> 32), double(m.save_id & 0xffffffffu),
                   -double(m.save_id >> 32), -double(m.save_id & 0xffffffffu)};
  comm.all_reduce(ids, 4, ReduceOp::min, at + " (same checkpoint)")->wait();
  if (ids[0] != -ids[2] || ids[1] != -ids[3])
    ZS_THROW(invalid_argument, at << ": the ranks resolved different checkpoints (was `latest` "
                                     "replaced during the load?); load a tag directory");

  // This rank's range of each unit's values, and the states this engine keeps.
  struct Span {
    ShardInfo si;
    int64_t b, e;
  };
  std::vector<Span> spans;
  for (int u = 0; u < num_units(); ++u) {
    const ShardInfo si = shard_info(u);
    const Range own = owned_by(si, shard_group().rank);
    spans.push_back({si, own.begin, own.end});
  }
  std::vector<int> states;
  for (size_t s = 0; s < state_names().size(); ++s)
    if (has_state(state_names()[s].kind) &&
        (options.optimizer_states || state_names()[s].kind == StateKind::master))
      states.push_back(int(s));

  // One pass: every block this rank needs is read once, verified as it lands, and written where
  // it goes, on this thread (a GPU's current device is per thread): in place where the tier
  // stores a state in host memory in the checkpoint's format (f32 straight from the disk; bf16
  // and 8-bit through a block buffer, as they are: 8-bit only in the same blocks), else converted
  // and through write_shard(). Every data file's header and checksum table are checked first,
  // before any state changes; a damaged block can only be found as it is read, so a load that
  // fails from there on leaves the engine holding no valid state, and step(), gather() and
  // save() refuse, naming the failed load, until a load succeeds (check_state()).
  std::vector<ReadTarget> all, direct;
  struct Stored {
    int s, u;
    StoredShard into;
  };
  std::vector<Stored> as_stored;
  std::vector<std::pair<int, int>> converted;  // (state, unit)
  for (int s : states)
    for (int u = 0; u < num_units(); ++u) {
      const Span& sp = spans[size_t(u)];
      all.push_back({s, u, sp.b, sp.e, nullptr});
      const Encoding enc = encoding_of(m, s);
      const StoredShard into = impl.state->stored(u, state_names()[size_t(s)].kind);
      const bool same = into.data && unpacks_into(enc, into.format, config().state_block);
      if (!same)
        converted.emplace_back(s, u);
      else if (enc.format == StateFormat::f32)  // the padding past e stays zero
        direct.push_back({s, u, sp.b, sp.e, static_cast<float*>(into.data)});
      else  // the padding past e keeps its zero codes
        as_stored.push_back({s, u, into});
    }
  all_or_none(comm, at + ": reading the data files' headers", [&] { check_files(dir, m, all); });
  impl.failed_load = at + " stopped part way";
  try {
    all_or_none(comm, at + ": reading shards", [&] {
      read_blocks(dir, m, direct);
      UnitReader src(dir, m);
      for (const Stored& t : as_stored)
        src.read_stored(t.s, t.u, spans[size_t(t.u)].b, spans[size_t(t.u)].e, t.into.data,
                        t.into.absmax);
      std::vector<float> v;
      for (auto [s, u] : converted) {
        const Span& sp = spans[size_t(u)];
        v.assign(size_t(sp.si.shard_numel), 0.0f);  // zeros: the padding
        src.read(s, u, sp.b, sp.e, v.data());
        write_shard(u, state_names()[size_t(s)].kind, v);
      }
    });
  } catch (const Error& e) {
    impl.failed_load = at + " failed part way (" + e.what() + ")";
    throw Error(e.code(), std::string(e.what()) +
                              " -- the engine holds no valid state now: step(), gather() and "
                              "save() refuse until a load succeeds");
  }
  commit_shards();
  if (options.optimizer_states) {
    set_step_count(m.step);
    set_loss_scaler_state(m.scaler);
  }
  if (options.hyperparameters)
    for (int g = 0; g < num_groups(); ++g) set_options(g, m.groups[size_t(g)]);
  impl.failed_load.clear();
}

}  // namespace zeroshard
