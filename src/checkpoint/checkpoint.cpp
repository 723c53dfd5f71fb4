// Checkpoints independent of world size and stage. Each state of each unit is one file of the
// unit's unpadded f32 values; every rank writes the part of its shard that holds parameters at
// its own offset, so no rank ever holds more than its shard (no consolidation in RAM) and any
// world size reads back any range. Built only on the engine's public shard API.
#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>

#include "src/base/check.hpp"
#include "src/base/unique_fd.hpp"
#include "zeroshard/engine.hpp"

namespace zeroshard {
namespace {

constexpr const char* kFormat = "zeroshard-checkpoint-1";

const std::vector<std::pair<StateKind, const char*>>& state_files() {
  static const std::vector<std::pair<StateKind, const char*>> s = {
      {StateKind::master, "master"}, {StateKind::state0, "state0"}, {StateKind::state1, "state1"}};
  return s;
}

std::filesystem::path state_path(const std::filesystem::path& dir, int unit, const char* state) {
  return dir / ("unit" + std::to_string(unit) + "." + state + ".f32");
}

// One open checkpoint file with positioned, whole-transfer reads and writes whose errors name
// the file. Each rank reads and writes its own range of a unit's file at its offset.
class CheckpointFile {
 public:
  CheckpointFile(const std::filesystem::path& p, int flags)
      : path_(p), fd_(::open(p.c_str(), flags | O_CLOEXEC, 0644)) {
    if (!fd_) ZS_THROW(io_error, "checkpoint: cannot open " << p << ": " << std::strerror(errno));
  }

  void write_at(const void* data, size_t bytes, off_t off) {
    const char* c = static_cast<const char*>(data);
    while (bytes > 0) {
      ssize_t n = ::pwrite(fd_.get(), c, bytes, off);
      if (n < 0 && errno == EINTR) continue;
      if (n < 0)
        ZS_THROW(io_error, "checkpoint: writing " << path_ << ": " << std::strerror(errno));
      c += n, bytes -= size_t(n), off += n;
    }
  }
  void read_at(void* data, size_t bytes, off_t off) {
    char* c = static_cast<char*>(data);
    while (bytes > 0) {
      ssize_t n = ::pread(fd_.get(), c, bytes, off);
      if (n < 0 && errno == EINTR) continue;
      if (n < 0)
        ZS_THROW(io_error, "checkpoint: reading " << path_ << ": " << std::strerror(errno));
      if (n == 0)
        ZS_THROW(corrupted, "checkpoint: " << path_ << " is shorter than its manifest says");
      c += n, bytes -= size_t(n), off += n;
    }
  }
  void resize(int64_t bytes) {
    if (::ftruncate(fd_.get(), off_t(bytes)) != 0)
      ZS_THROW(io_error, "checkpoint: sizing " << path_ << ": " << std::strerror(errno));
  }
  void sync() {
    if (::fsync(fd_.get()) != 0)
      ZS_THROW(io_error, "checkpoint: fsync " << path_ << ": " << std::strerror(errno));
  }
  int64_t size() const {
    off_t end = ::lseek(fd_.get(), 0, SEEK_END);
    if (end < 0)
      ZS_THROW(io_error, "checkpoint: size of " << path_ << ": " << std::strerror(errno));
    return end;
  }

 private:
  std::filesystem::path path_;
  UniqueFd fd_;
};

nlohmann::json describe_model(const Engine& e) {
  nlohmann::json units = nlohmann::json::array();
  for (int u = 0; u < e.num_units(); ++u) {
    nlohmann::json params = nlohmann::json::array();
    for (const Param& p : e.unit_params(u))
      params.push_back({{"name", p.name}, {"shape", p.shape}});
    units.push_back(
        {{"name", e.unit_name(u)}, {"numel", e.shard_info(u).numel}, {"params", params}});
  }
  return units;
}

// A collective outcome: every rank learns whether any failed, so none waits for a dead peer.
void agree(Communicator& comm, bool ok, const std::string& what) {
  double failed = ok ? 0 : 1;
  comm.all_reduce(&failed, 1, ReduceOp::max, what)->wait();
  if (failed > 0 && ok) ZS_THROW(io_error, what << ": failed on another rank (see its error)");
}

// The range of unit values this rank's shard holds: [begin, end) in unpadded elements.
std::pair<int64_t, int64_t> owned(const ShardInfo& s) {
  int64_t b = std::min(s.shard_offset, s.numel),
          e = std::min(s.shard_offset + s.shard_numel, s.numel);
  return {b, e};
}

}  // namespace

void Engine::save(const std::filesystem::path& dir) {
  Communicator& comm = *communicator();
  // Collective names must be the same on every rank (the communicator adds the rank itself).
  const std::string at = "save(" + dir.string() + ")";
  // Rank 0 lays out the files (so every later pwrite lands in a file of the right size) and
  // removes the old manifest first: a crash mid-save leaves no manifest, never a mixed one.
  std::string err;
  if (rank() == 0) try {
      std::filesystem::create_directories(dir);
      std::filesystem::remove(dir / "manifest.json");
      for (int u = 0; u < num_units(); ++u)
        for (auto [kind, name] : state_files())
          if (has_state(kind))
            CheckpointFile(state_path(dir, u, name), O_WRONLY | O_CREAT | O_TRUNC)
                .resize(shard_info(u).numel * 4);
    } catch (const std::exception& ex) {
      err = ex.what();
    }
  agree(comm, err.empty(), at + ": preparing the directory");
  if (!err.empty()) ZS_THROW(io_error, at << " on rank " << rank() << ": " << err);
  try {
    for (int u = 0; u < num_units(); ++u) {
      auto [b, e] = owned(shard_info(u));
      for (auto [kind, name] : state_files()) {
        if (!has_state(kind) || b >= e) continue;
        std::vector<float> v = read_shard(u, kind);
        CheckpointFile f(state_path(dir, u, name), O_WRONLY);
        f.write_at(v.data(), size_t(e - b) * 4, off_t(b) * 4);
        f.sync();
      }
    }
  } catch (const std::exception& ex) {
    err = ex.what();
  }
  agree(comm, err.empty(), at + ": writing shards");
  if (!err.empty()) ZS_THROW(io_error, at << " on rank " << rank() << ": " << err);
  if (rank() == 0) try {
      nlohmann::json m = {{"format", kFormat},
                          {"step", step_count()},
                          {"loss_scale", loss_scale()},
                          {"loss_scaler",
                           {{"hysteresis_left", loss_scaler_state().hysteresis_left},
                            {"iteration", loss_scaler_state().iteration},
                            {"last_overflow", loss_scaler_state().last_overflow}}},
                          {"world_size", world_size()},
                          {"stage", config().stage},
                          {"dtype", dtype_name(config().dtype)},
                          {"optimizer", optimizer_name(config().optimizer.kind)},
                          {"units", describe_model(*this)}};
      std::filesystem::path tmp = dir / "manifest.json.tmp";
      {
        std::ofstream os(tmp);
        os << m.dump(1) << "\n";
        if (!os.flush()) ZS_THROW(io_error, "cannot write " << tmp);
      }
      CheckpointFile(tmp, O_RDONLY).sync();
      std::filesystem::rename(tmp, dir / "manifest.json");
    } catch (const std::exception& ex) {
      err = ex.what();
    }
  agree(comm, err.empty(), at + ": writing the manifest");
  if (!err.empty()) ZS_THROW(io_error, at << " on rank " << rank() << ": " << err);
}

void Engine::load(const std::filesystem::path& dir) {
  const std::string at = "load(" + dir.string() + ")";
  nlohmann::json m;
  {
    std::ifstream is(dir / "manifest.json");
    if (!is)
      ZS_THROW(invalid_argument,
               at << ": no manifest.json (not a checkpoint, or an incomplete save)");
    try {
      is >> m;
    } catch (const std::exception& ex) {
      ZS_THROW(corrupted, at << ": manifest.json: " << ex.what());
    }
  }
  if (m.value("format", "") != kFormat)
    ZS_THROW(invalid_argument,
             at << ": format " << m.value("format", "?") << ", expected " << kFormat);
  if (m.value("optimizer", "") != optimizer_name(config().optimizer.kind))
    ZS_THROW(invalid_argument, at << ": checkpoint holds " << m.value("optimizer", "?")
                                  << " state, this engine runs "
                                  << optimizer_name(config().optimizer.kind));
  // The model must be the same, unit by unit and parameter by parameter.
  const nlohmann::json want = describe_model(*this), got = m.at("units");
  for (size_t u = 0; u < std::max(want.size(), got.size()); ++u) {
    if (u >= got.size() || u >= want.size() || want[u] != got[u])
      ZS_THROW(invalid_argument, at << ": the model differs at unit " << u << ": checkpoint has "
                                    << (u < got.size() ? got[u].dump() : "nothing")
                                    << ", engine has "
                                    << (u < want.size() ? want[u].dump() : "nothing"));
  }
  // Every rank reads its own ranges; they agree on the outcome before the collective commit, so
  // a rank that fails never leaves the others waiting.
  std::string err;
  ErrorCode code = ErrorCode::io_error;
  try {
    for (int u = 0; u < num_units(); ++u) {
      const ShardInfo s = shard_info(u);
      auto [b, e] = owned(s);
      for (auto [kind, name] : state_files()) {
        if (!has_state(kind)) continue;
        std::vector<float> v(static_cast<size_t>(s.shard_numel), 0.0f);  // padding stays zero
        CheckpointFile f(state_path(dir, u, name), O_RDONLY);
        if (f.size() != s.numel * 4)
          ZS_THROW(corrupted, state_path(dir, u, name)
                                  << " has " << f.size() << " bytes, expected " << s.numel * 4);
        if (b < e) f.read_at(v.data(), size_t(e - b) * 4, off_t(b) * 4);
        write_shard(u, kind, v);
      }
    }
  } catch (const Error& ex) {
    err = ex.what();
    code = ex.code();
  }
  agree(*communicator(), err.empty(), at + ": reading shards");
  if (!err.empty()) throw Error(code, at + " on rank " + std::to_string(rank()) + ": " + err);
  commit_shards();
  set_step_count(m.at("step").get<int64_t>());
  set_loss_scale(m.at("loss_scale").get<float>());
  if (m.contains("loss_scaler")) {  // written since the scaler's counters are saved too
    const nlohmann::json& ls = m.at("loss_scaler");
    set_loss_scaler_state({m.at("loss_scale").get<float>(), ls.at("hysteresis_left").get<int>(),
                           ls.at("iteration").get<int64_t>(),
                           ls.at("last_overflow").get<int64_t>()});
  }
}

}  // namespace zeroshard
