// Engine::load: reads a checkpoint at any world size and stage (format.hpp), all or nothing.
// Everything is checked before any state changes: the manifest (schema, types, ranges), the
// model against it (naming the first parameter that differs), every file's header and checksum
// table, and then every block this rank will read, which is read a first time only to verify
// it. Only once every rank found everything intact does the second pass write the shards. A
// failed load therefore leaves the engine exactly as it was. The page cache keeps what the first
// pass read for the second where memory allows; the second pass verifies again what it reads.
#include <algorithm>
#include <exception>
#include <map>
#include <thread>

#include "src/base/check.hpp"
#include "src/checkpoint/collective.hpp"
#include "src/checkpoint/data_file.hpp"
#include "src/checkpoint/format.hpp"
#include "src/engine_impl.hpp"

namespace zeroshard {

namespace fs = std::filesystem;
using namespace ckpt;

namespace {

// f(t) for every t in [0, n), each in a thread of its own; once all have ended, rethrows the
// first error any of them threw.
template <class F>
void in_threads(size_t n, F&& f) {
  std::vector<std::exception_ptr> errors(n);
  std::vector<std::thread> threads;
  try {
    for (size_t t = 0; t < n; ++t)
      threads.emplace_back([&, t] {
        try {
          f(t);
        } catch (...) {
          errors[t] = std::current_exception();
        }
      });
  } catch (...) {  // a thread that could not start: the others end first
    for (std::thread& t : threads) t.join();
    throw;
  }
  for (std::thread& t : threads) t.join();
  for (const std::exception_ptr& e : errors)
    if (e) std::rethrow_exception(e);
}

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
    for (size_t i = 0; i < want.size(); ++i)
      if (got.params[i].name != want[i].name || got.params[i].shape != want[i].shape)
        ZS_THROW(invalid_argument, at << ": the model differs at unit " << u << " ('"
                                      << e.unit_name(u) << "'), parameter " << i
                                      << ": the checkpoint has '" << got.params[i].name << "' "
                                      << shape_string(got.params[i].shape) << ", this engine '"
                                      << want[i].name << "' " << shape_string(want[i].shape));
  }
}

}  // namespace

void Engine::load(const std::filesystem::path& path) {
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
    for (int g = 0; g < num_groups(); ++g) {
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
    const Range own = owned_by(si, rank());
    spans.push_back({si, own.begin, own.end});
  }
  std::vector<int> states;
  for (size_t s = 0; s < state_names().size(); ++s)
    if (has_state(state_names()[s].kind)) states.push_back(int(s));

  // The first pass reads every block this rank needs and verifies it, with many reads in
  // flight (threads taking slices of each state's blocks, the same blocks in every state's
  // files, each reader asking for the blocks ahead of it). The page cache keeps what it read for
  // the second pass, a thread per state, which reads and verifies again (a block evicted in between
  // comes from the disk, and one changed in between is caught) and writes the state (in place where
  // the tier keeps it in host memory).
  std::vector<UnitReader> src;  // one per state
  src.reserve(states.size());
  for (size_t i = 0; i < states.size(); ++i) src.emplace_back(dir, m);
  std::vector<std::pair<int, int64_t>> need;  // (file rank, block)
  for (int u = 0; u < num_units(); ++u)
    src.front().blocks(u, spans[size_t(u)].b, spans[size_t(u)].e, need);  // master: always
  constexpr size_t kLanes = 8;  // threads, shared out among the states
  const size_t lanes = (kLanes + states.size() - 1) / states.size();
  all_or_none(comm, at + ": verifying", [&] {
    in_threads(states.size() * lanes, [&](size_t t) {
      const size_t i = t / lanes, lane = t % lanes, n = need.size();
      const int s = states[i];
      std::map<int, std::unique_ptr<DataFileReader>> files;
      for (size_t k = n * lane / lanes; k < n * (lane + 1) / lanes; ++k) {
        const auto [r, b] = need[k];
        std::unique_ptr<DataFileReader>& f = files[r];
        if (!f)
          f = std::make_unique<DataFileReader>(
              dir / data_file_name(r, state_names()[size_t(s)].name), expected_header(m, r, s));
        f->verify_block(b);
      }
    });
  });
  try {
    all_or_none(comm, at + ": reading shards", [&] {
      // A thread per state where the tier keeps every state in host memory; else on this
      // thread, which write_shard() needs (a GPU's current device is per thread).
      bool in_place = true;
      for (int u = 0; u < num_units(); ++u)
        for (int s : states)
          in_place &= impl.state->host_target(u, state_names()[size_t(s)].kind) != nullptr;
      auto apply = [&](size_t i) {
        const StateKind kind = state_names()[size_t(states[i])].kind;
        std::vector<float> v;
        for (int u = 0; u < num_units(); ++u) {
          const Span& sp = spans[size_t(u)];
          float* dst = in_place ? impl.state->host_target(u, kind) : nullptr;
          if (!dst) v.resize(size_t(sp.si.shard_numel));
          float* out = dst ? dst : v.data();
          src[i].read(states[i], u, sp.b, sp.e, out);
          std::fill(out + (sp.e - sp.b), out + sp.si.shard_numel, 0.0f);  // the padding
          if (!dst) write_shard(u, kind, v);
        }
      };
      if (in_place)
        in_threads(states.size(), apply);
      else
        for (size_t i = 0; i < states.size(); ++i) apply(i);
    });
  } catch (const Error& e) {
    // Verified a moment ago: only an I/O error or a file changed since can get here.
    throw Error(e.code(), std::string(e.what()) +
                              " -- the engine's state is partly loaded; load again or rebuild it");
  }
  commit_shards();
  set_step_count(m.step);
  set_loss_scaler_state(m.scaler);
  for (int g = 0; g < num_groups(); ++g) set_options(g, m.groups[size_t(g)]);
}

}  // namespace zeroshard
