// Engine::save: a crash-safe checkpoint (format.hpp). The tag is written under a temporary name
// that no load reads, every file fsynced; only then is it renamed into place and `latest`
// replaced, each step fsynced through the directory. A save that dies at any point leaves the
// root as it was, plus a temporary directory the next save removes. A save never touches an
// existing tag. Every rank streams the range of each unit its shard holds, unit by unit, so no
// rank holds more than one unit's shard at a time and nothing is ever gathered.
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <memory>
#include <random>

#include "src/base/check.hpp"
#include "src/base/unique_fd.hpp"
#include "src/checkpoint/collective.hpp"
#include "src/checkpoint/data_file.hpp"
#include "src/checkpoint/format.hpp"
#include "src/engine_impl.hpp"

namespace zeroshard {

namespace fs = std::filesystem;
using namespace ckpt;

namespace {

constexpr const char* kTempPrefix = ".tmp-";

void fsync_path(const fs::path& p, int flags) {
  UniqueFd fd(::open(p.c_str(), flags | O_CLOEXEC));
  if (!fd || ::fsync(fd.get()) != 0)
    ZS_THROW(io_error, "checkpoint: fsync of " << p << ": " << std::strerror(errno));
}
void fsync_dir(const fs::path& p) { fsync_path(p, O_RDONLY | O_DIRECTORY); }

void write_file(const fs::path& p, const std::string& text) {
  UniqueFd fd(::open(p.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
  if (!fd) ZS_THROW(io_error, "checkpoint: creating " << p << ": " << std::strerror(errno));
  const char* c = text.data();
  size_t left = text.size();
  while (left > 0) {
    const ssize_t n = ::write(fd.get(), c, left);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      const int err = errno;
      if (err == ENOSPC || err == EDQUOT)
        ZS_THROW(no_space, "checkpoint: writing " << p << ": " << std::strerror(err));
      ZS_THROW(io_error, "checkpoint: writing " << p << ": " << std::strerror(err));
    }
    c += n, left -= size_t(n);
  }
  if (::fsync(fd.get()) != 0)
    ZS_THROW(io_error, "checkpoint: fsync of " << p << ": " << std::strerror(errno));
}

// Values [begin, end) of unit u that rank r's shard holds (empty when it holds only padding).
Range owned_by(const ShardInfo& s, int r) {
  const int64_t b = std::min(int64_t(r) * s.shard_numel, s.numel);
  const int64_t e = std::min(int64_t(r + 1) * s.shard_numel, s.numel);
  return {0, b, e, 0};
}

// Rank 0, before anything is written: the tag must be new; temporary directories of saves
// that died are removed; this save's is created.
void prepare(const fs::path& root, const std::string& tag, const fs::path& tmp) {
  fs::create_directories(root);
  if (fs::exists(root / tag))
    ZS_THROW(invalid_argument, "checkpoint: tag " << (root / tag)
                                                  << " exists; a save never modifies an existing "
                                                     "tag (give another tag, or remove it)");
  for (const fs::directory_entry& d : fs::directory_iterator(root))
    if (d.path().filename().string().rfind(kTempPrefix, 0) == 0) fs::remove_all(d.path());
  fs::create_directory(tmp);
}

// Rank 0, once every rank's files are durable: the manifest, the tag's rename into place, and
// `latest`, each made durable before the next.
void publish(const fs::path& root, const fs::path& tmp, const std::string& tag,
             const Manifest& m) {
  write_file(tmp / "manifest.json", manifest_text(m));
  fsync_dir(tmp);
  fs::rename(tmp, root / tag);
  fsync_dir(root);
  write_file(root / "latest.tmp", tag + "\n");
  fs::rename(root / "latest.tmp", root / "latest");
  fsync_dir(root);
}

// Keeps the newest `keep` tags (by their manifests' write time) and the one `latest` names. A
// failure here loses nothing and is reported on stderr, not thrown: the save itself succeeded.
void prune(const fs::path& root, const std::string& current, int keep) {
  if (keep <= 0) return;
  try {
    std::vector<std::pair<fs::file_time_type, fs::path>> tags;
    for (const fs::directory_entry& d : fs::directory_iterator(root)) {
      const std::string name = d.path().filename().string();
      if (name.rfind(kTempPrefix, 0) == 0 || !fs::exists(d.path() / "manifest.json")) continue;
      tags.emplace_back(fs::last_write_time(d.path() / "manifest.json"), d.path());
    }
    std::sort(tags.rbegin(), tags.rend());
    for (size_t i = size_t(keep); i < tags.size(); ++i)
      if (tags[i].second.filename() != current) fs::remove_all(tags[i].second);
    fsync_dir(root);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "zeroshard: checkpoint: pruning old tags in %s failed: %s\n",
                 root.c_str(), e.what());
  }
}

}  // namespace

std::filesystem::path Engine::save(const std::filesystem::path& root, const std::string& tag_in) {
  Communicator& comm = *communicator();
  char step_tag[32];
  std::snprintf(step_tag, sizeof step_tag, "step%08lld", static_cast<long long>(step_count()));
  const std::string tag = tag_in.empty() ? std::string(step_tag) : tag_in;
  check_tag(tag);
  const std::string at = "save(" + (root / tag).string() + ")";

  uint64_t save_id = std::random_device{}() | (uint64_t(std::random_device{}()) << 32);
  comm.broadcast(&save_id, 8, 0, at + " (save id)")->wait();
  char id[17];
  std::snprintf(id, sizeof id, "%016llx", static_cast<unsigned long long>(save_id));
  const fs::path tmp = root / (kTempPrefix + tag + "." + id);
  all_or_none(comm, at + ": preparing", [&] {
    if (rank() == 0) prepare(root, tag, tmp);
  });

  Manifest m;
  m.tag = tag;
  m.save_id = save_id;
  m.world_size = world_size();
  m.stage = config().stage;
  m.dtype = dtype_name(config().dtype);
  m.optimizer = optimizer_name(config().optimizer.kind);
  m.step = step_count();
  m.scaler = loss_scaler_state();
  for (int g = 0; g < num_groups(); ++g) m.groups.push_back(options(g));
  m.block_bytes = kBlockBytes;
  m.ranges.resize(size_t(world_size()));
  for (int u = 0; u < num_units(); ++u) {
    const ShardInfo s = shard_info(u);
    ZS_CHECK(s.shard_offset == int64_t(rank()) * s.shard_numel);
    UnitInfo info{unit_name(u), s.numel, {}};
    for (const Param& p : unit_params(u)) info.params.push_back({p.name, p.shape});
    m.units.push_back(std::move(info));
    for (int r = 0; r < world_size(); ++r) {
      Range rg = owned_by(s, r);
      if (rg.begin >= rg.end) continue;
      auto& list = m.ranges[size_t(r)];
      rg.unit = u;
      rg.offset = list.empty() ? 0 : list.back().offset + (list.back().end - list.back().begin);
      list.push_back(rg);
    }
  }
  int64_t mine = 0;
  for (const Range& rg : m.ranges[size_t(rank())]) mine += rg.end - rg.begin;

  // A failed save leaves nothing behind: its temporary directory goes at once (freeing the
  // space of a full disk), and the root is as it was.
  try {
    all_or_none(comm, at + ": writing shards", [&] {
      // One file per state, filled unit by unit side by side, so that each file's writer
      // thread has a block in flight at the same time.
      std::vector<std::unique_ptr<DataFileWriter>> files;
      std::vector<StateKind> kinds;
      for (size_t s = 0; s < state_names().size(); ++s) {
        const StateName& sn = state_names()[s];
        if (!has_state(sn.kind)) continue;
        m.states.push_back(sn.name);
        kinds.push_back(sn.kind);
        files.push_back(std::make_unique<DataFileWriter>(
            tmp / data_file_name(rank(), sn.name),
            FileHeader{save_id, rank(), int32_t(s), kBlockBytes, mine * 4}));
      }
      for (const Range& rg : m.ranges[size_t(rank())])
        for (size_t i = 0; i < files.size(); ++i) {
          // The shard starts at rg.begin; in host memory it is read in place.
          const size_t bytes = size_t(rg.end - rg.begin) * 4;
          if (const float* v = impl_->state->host_view(rg.unit, kinds[i])) {
            files[i]->append(v, bytes);
          } else {
            const std::vector<float> copy = read_shard(rg.unit, kinds[i]);
            files[i]->append(copy.data(), bytes);
          }
        }
      for (auto& f : files) f->finish();
    });
    all_or_none(comm, at + ": publishing", [&] {
      if (rank() != 0) return;
      publish(root, tmp, tag, m);
      prune(root, tag, config().checkpoint_keep_last);
    });
  } catch (const Error&) {
    std::error_code ec;
    if (rank() == 0) fs::remove_all(tmp, ec);
    throw;
  }
  return root / tag;
}

}  // namespace zeroshard
