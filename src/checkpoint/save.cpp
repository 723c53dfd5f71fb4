// Engine::save: a crash-safe checkpoint (format.hpp). The tag is written under a temporary name
// that no load reads, every file fsynced; only then is it renamed into place and `latest`
// replaced, each step fsynced through the directory. A save that dies at any point leaves the
// root as it was, plus a temporary directory the next save removes. A save never touches an
// existing tag. Every rank streams the range of each unit its shard holds, unit by unit, so no
// rank holds more than one unit's shard at a time and nothing is ever gathered.
// save_async() takes a snapshot (kept by the nvme tier in its record slots, else copied into
// host memory; in the ledger either way) and a thread writes the files while training goes on;
// finish_save() publishes the tag.
#include <fcntl.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iterator>
#include <memory>
#include <optional>
#include <random>
#include <system_error>
#include <thread>
#include <tuple>

#include "base/check.hpp"
#include "base/unique_fd.hpp"
#include "src/checkpoint/collective.hpp"
#include "src/checkpoint/data_file.hpp"
#include "src/checkpoint/encoding.hpp"
#include "src/checkpoint/file_io.hpp"
#include "src/checkpoint/format.hpp"
#include "src/checkpoint/module_file.hpp"
#include "src/checkpoint/safetensors.hpp"
#include "src/engine_impl.hpp"

namespace zeroshard {

namespace fs = std::filesystem;
using namespace ckpt;

namespace {

constexpr const char* kTempPrefix = ".tmp-";

void write_file(const fs::path& p, const std::string& text) {
  UniqueFd fd(::open(p.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
  if (!fd) io_failure(p, "creating", errno);
  pwrite_all(fd.get(), text.data(), text.size(), 0, p);
  fsync_fd(fd.get(), p);
}

// The tag root/latest names ("" when there is none).
std::string latest_tag(const fs::path& root) {
  std::ifstream is(root / "latest", std::ios::binary);
  std::string text((std::istreambuf_iterator<char>(is)), std::istreambuf_iterator<char>());
  if (!text.empty() && text.back() == '\n') text.pop_back();
  return text;
}

// Whether root/latest names `tag` (and nothing else).
bool names_latest(const fs::path& root, const std::string& tag) {
  return latest_tag(root) == tag;
}

// Whether root/tag is a complete tag that was never published: a save killed after renaming
// it into place and before pointing `latest` at it. Then `latest` names an older step (or
// nothing). A tag published once and superseded since is older than `latest`'s: it is not
// this, and neither is anything whose manifests cannot be read.
bool unpublished(const fs::path& root, const std::string& tag) {
  const std::string latest = latest_tag(root);
  if (latest == tag) return false;
  try {
    const int64_t step = read_manifest(root / tag).step;
    return latest.empty() || !fs::exists(root / latest) || step > read_manifest(root / latest).step;
  } catch (const Error&) {
    return false;
  }
}

// Rank 0, before anything is written: the tag must be new (a complete one that was never
// published is replaced: the restarted job that saves it again reached the same step);
// temporary directories of saves that died are removed; this save's is created.
void prepare(const fs::path& root, const std::string& tag, const fs::path& tmp) {
  make_directories(root);
  if (fs::exists(root / tag)) {
    if (!unpublished(root, tag))
      ZS_THROW(invalid_argument, "checkpoint: tag "
                                     << (root / tag)
                                     << " exists; a save never modifies an existing tag (give "
                                        "another tag, or remove it)");
    // Renamed to a temporary name first, as prune() does: a removal cut short leaves no tag.
    const std::string latest = latest_tag(root);
    std::fprintf(stderr,
                 "zeroshard: checkpoint: tag %s is complete but was never published (`latest` "
                 "names %s): a save was killed before pointing `latest` at it; replacing it\n",
                 (root / tag).c_str(), latest.empty() ? "nothing" : latest.c_str());
    const fs::path doomed = root / (kTempPrefix + tag + ".unpublished");
    fs::remove_all(doomed);
    rename_path(root / tag, doomed);
    fsync_path(root);
  }
  for (const fs::directory_entry& d : fs::directory_iterator(root))
    if (d.path().filename().string().rfind(kTempPrefix, 0) == 0) fs::remove_all(d.path());
  make_directory(tmp);
}

// Rank 0, once every rank's files are durable: the manifest, the tag's rename into place, and
// `latest`, each made durable before the next.
void publish(const fs::path& root, const fs::path& tmp, const std::string& tag, const Manifest& m) {
  write_file(tmp / "manifest.json", manifest_text(m));
  fsync_path(tmp);
  rename_path(tmp, root / tag);
  fsync_path(root);
  write_file(root / "latest.tmp", tag + "\n");
  rename_path(root / "latest.tmp", root / "latest");
  fsync_path(root);
}

// Keeps the newest `keep` tags (by the step their manifests record, then their write time) and
// the one `latest` names. A tag is renamed to a temporary name before it is removed, so that a
// removal cut short leaves no half tag (the next save removes the rest). A failure here loses
// nothing and is reported on stderr, not thrown: the save itself succeeded.
void prune(const fs::path& root, const std::string& current, int keep) {
  if (keep <= 0) return;
  try {
    std::vector<std::tuple<int64_t, fs::file_time_type, fs::path>> tags;
    for (const fs::directory_entry& d : fs::directory_iterator(root)) {
      const std::string name = d.path().filename().string();
      if (name.rfind(kTempPrefix, 0) == 0 || !fs::exists(d.path() / "manifest.json")) continue;
      int64_t step = -1;
      try {
        step = read_manifest(d.path()).step;
      } catch (const Error&) {
        continue;  // not a tag this code can read: left alone
      }
      tags.emplace_back(step, fs::last_write_time(d.path() / "manifest.json"), d.path());
    }
    std::sort(tags.rbegin(), tags.rend());
    for (size_t i = size_t(keep); i < tags.size(); ++i) {
      const fs::path& dir = std::get<2>(tags[i]);
      if (dir.filename() == current) continue;
      const fs::path doomed = root / (kTempPrefix + dir.filename().string() + ".pruned");
      fs::rename(dir, doomed);
      fsync_path(root);
      fs::remove_all(doomed);
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "zeroshard: checkpoint: pruning old tags in %s failed: %s\n", root.c_str(),
                 e.what());
  }
}

// A save between its start and its publication: where it goes, its manifest, the states it
// writes (their indices in state_names()), and, for save_async(), its writer thread and the
// thread's outcome.
struct PendingSave {
  fs::path root, tmp;
  std::string at;
  Manifest m;
  std::vector<int> states;
  ModuleState module;              // what world rank 0 writes beside the state (module_file.hpp)
  std::thread writer;              // save_async(): writes from Engine::Impl::save.snapshot
  std::atomic<bool> hurry{false};  // finish_save() waits: the writing gives way no more
  std::optional<Error> error;
  ~PendingSave() {
    if (writer.joinable()) writer.join();
  }
};

// The manifest of a save of `e` as it is now, but for its tag and id, and the states it writes
// (their indices in state_names()). Local: no collective.
Manifest describe(Engine& e, std::vector<int>& states) {
  Manifest m;
  // Hierarchical sharding: the first group writes the checkpoint, whose shards are those of a
  // flat run of the group's size (the other groups hold the same).
  const ShardGroup sg = e.shard_group();
  m.world_size = sg.size;
  m.stage = e.config().stage;
  m.dtype = dtype_name(e.config().dtype);
  m.optimizer = optimizer_name(e.config().optimizer.kind);
  m.step = e.step_count();
  m.scaler = e.loss_scaler_state();
  for (int g = 0; g < e.num_groups(); ++g) m.groups.push_back(e.options(g));
  m.state_format = e.config().optimizer_state;
  m.state_block = m.state_format == StateFormat::q8 ? e.config().state_block : 0;
  m.block_bytes = kBlockBytes;
  states.clear();
  for (size_t s = 0; s < state_names().size(); ++s)
    if (e.has_state(state_names()[s].kind)) {
      m.states.push_back(state_names()[s].name);
      states.push_back(int(s));
    }
  m.ranges.resize(size_t(sg.size));
  for (int u = 0; u < e.num_units(); ++u) {
    const ShardInfo s = e.shard_info(u);
    ZS_CHECK(s.shard_offset == int64_t(sg.rank) * s.shard_numel);
    UnitInfo info{e.unit_name(u), s.numel, {}};
    for (const Param& prm : e.unit_params(u))
      info.params.push_back({prm.name, prm.shape, prm.group});
    m.units.push_back(std::move(info));
    for (int r = 0; r < sg.size; ++r) {
      Range rg = owned_by(s, r);
      if (rg.begin >= rg.end) continue;
      auto& list = m.ranges[size_t(r)];
      rg.unit = u;
      rg.offset = list.empty() ? 0 : list.back().offset + (list.back().end - list.back().begin);
      list.push_back(rg);
    }
  }
  return m;
}

// Rank r's data files' contents, state after state, as save_async()'s snapshot holds them: its
// size, and where each state starts in it.
size_t snapshot_bytes(const Manifest& m, const std::vector<int>& states, int r,
                      std::vector<size_t>* starts = nullptr) {
  size_t total = 0;
  for (int s : states) {
    if (starts) starts->push_back(total);
    total += size_t(expected_header(m, r, s).data_bytes);
  }
  return total;
}

// Rank 0 names the save; the tag must be new; the temporary directory is made. Collective.
std::unique_ptr<PendingSave> start(Engine& e, const fs::path& root, const std::string& tag_in) {
  Communicator& comm = *e.communicator();
  char step_tag[32];
  std::snprintf(step_tag, sizeof step_tag, "step%08lld", static_cast<long long>(e.step_count()));
  auto p = std::make_unique<PendingSave>();
  const std::string tag = tag_in.empty() ? std::string(step_tag) : tag_in;
  check_tag(tag);
  p->root = root;
  p->at = "save(" + (root / tag).string() + ")";
  uint64_t save_id = std::random_device{}() | (uint64_t(std::random_device{}()) << 32);
  comm.broadcast(&save_id, 8, 0, p->at + " (save id)")->wait();
  p->tmp = root / (kTempPrefix + tag + "." + hex64(save_id));
  all_or_none(comm, p->at + ": preparing", [&] {
    if (e.rank() == 0) prepare(root, tag, p->tmp);
  });
  p->m = describe(e, p->states);
  p->m.tag = tag;
  p->m.save_id = save_id;
  return p;
}

// This rank's data files: one per state, filled unit by unit side by side, so that each file's
// writer thread has a block in flight at the same time. bytes(i, range) is where the range of
// the i-th state starts as the file holds it (encoding.hpp).
// An asynchronous save from its snapshot in memory gives way to the trainer: while the engine's
// step() runs, its data goes to the files no further (a step whose update fills the cores and
// the memory's bandwidth ran up to 1.24× slower beside the save's copies, checksums and writes;
// benchmarks/results/offload.md), but for the blocks already handed to the writer threads, until
// finish_save() waits for it. Not the nvme tier's snapshot: its step waits for the save to read
// the records it would overwrite.
struct GiveWay {
  static constexpr size_t kPiece = size_t(4) << 20;  // bytes appended between two looks
  const std::atomic<bool>* stepping = nullptr;
  const std::atomic<bool>* hurry = nullptr;
  void wait() const {
    while (stepping && stepping->load(std::memory_order_relaxed) &&
           !hurry->load(std::memory_order_relaxed))
      std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
};

template <class Bytes>
void write_files(const PendingSave& p, int rank, Bytes&& bytes, const GiveWay& give_way = {}) {
  std::vector<std::unique_ptr<DataFileWriter>> files;
  for (int s : p.states)
    files.push_back(std::make_unique<DataFileWriter>(
        p.tmp / data_file_name(rank, state_names()[size_t(s)].name),
        expected_header(p.m, rank, s)));
  for (const Range& rg : p.m.ranges[size_t(rank)])
    for (size_t i = 0; i < files.size(); ++i) {
      const char* from = static_cast<const char*>(bytes(i, rg));
      const size_t n = size_t(encoded_bytes(encoding_of(p.m, p.states[i]), rg.end - rg.begin));
      for (size_t at = 0; at < n; at += GiveWay::kPiece) {
        give_way.wait();
        files[i]->append(from + at, std::min(GiveWay::kPiece, n - at));
      }
    }
  for (auto& f : files) f->finish();
}

// Once every rank's files are durable: rank 0 publishes the tag. A failed save leaves nothing
// behind: its temporary directory goes at once (freeing the space of a full disk), and the root
// is as it was.
fs::path finish(Engine& e, PendingSave& p, const std::optional<Error>& written) {
  Communicator& comm = *e.communicator();
  try {
    all_or_none(comm, p.at + ": writing shards", [&] {
      if (written) throw *written;
    });
    all_or_none(comm, p.at + ": publishing", [&] {
      if (e.rank() == 0) publish(p.root, p.tmp, p.m.tag, p.m);
    });
  } catch (const Error&) {
    // Nothing of a failed save stays: a tag renamed into place that `latest` does not name yet
    // goes too, so that the same tag can be saved again.
    std::error_code ec;
    if (e.rank() == 0) {
      fs::remove_all(p.tmp, ec);
      if (!names_latest(p.root, p.m.tag)) fs::remove_all(p.root / p.m.tag, ec);
    }
    throw;
  }
  // After the agreement: a slow removal must not hold the other ranks in a timed collective.
  if (e.rank() == 0) prune(p.root, p.m.tag, e.config().checkpoint_keep_last);
  return p.root / p.m.tag;
}

template <class F>
std::optional<Error> outcome(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e;
  } catch (const std::exception& e) {
    return Error(ErrorCode::io_error, e.what());
  }
  return std::nullopt;
}

// Range rg of the i-th state of a save as its data file holds it (encoding.hpp): the tier's
// own bytes where it stores the state in host memory (in place but for 8-bit, whose blocks are
// interleaved with their absmax: no conversion either way), else its f32 values (from the nvme
// tier's snapshot, or read from the tier) encoded. `scratch` and `copy` hold what is made here.
class RangeSource {
 public:
  // Reads `frozen` where the tier handed a snapshot, else `tier` (a writer thread of
  // save_async() has only the snapshot: tier null).
  RangeSource(const PendingSave& p, StateTier* tier, StateSnapshot* frozen)
      : p_(p), tier_(tier), frozen_(frozen) {}
  const char* operator()(size_t i, const Range& rg) {
    const Encoding e = encoding_of(p_.m, p_.states[i]);
    const StateKind kind = state_names()[size_t(p_.states[i])].kind;
    const int64_t n = rg.end - rg.begin;  // from the shard's first value (owned_by())
    const float* values = nullptr;
    if (frozen_) {
      values = frozen_->view(rg.unit, kind);
    } else if (const StoredShard s = tier_->stored(rg.unit, kind); s.data) {
      ZS_CHECK(s.format == e.format);
      if (e.format != StateFormat::q8) return static_cast<const char*>(s.data);
      scratch_.resize(size_t(encoded_bytes(e, n)));
      pack(e, s.data, s.absmax, n, scratch_.data());
      return scratch_.data();
    } else {
      copy_ = tier_->read(rg.unit, kind);
      values = copy_.data();
    }
    if (e.format == StateFormat::f32) return reinterpret_cast<const char*>(values);
    scratch_.resize(size_t(encoded_bytes(e, n)));
    encode(e, values, n, scratch_.data());
    return scratch_.data();
  }

 private:
  const PendingSave& p_;
  StateTier* tier_;
  StateSnapshot* frozen_;
  std::vector<char> scratch_;
  std::vector<float> copy_;
};

}  // namespace

std::filesystem::path Engine::save(const std::filesystem::path& root, const std::string& tag,
                                   const ModuleState& module) {
  if (!impl_->finalized)
    ZS_THROW(invalid_argument, "rank " << rank() << ": save(" << root.string()
                                       << ") before finalize(): there is no state to save yet");
  impl_->check_state("save");
  finish_save();
  std::unique_ptr<PendingSave> p = start(*this, root, tag);
  std::unique_ptr<StateSnapshot> frozen;  // the nvme tier's: each unit's record read once
  const std::optional<Error> written = outcome([&] {
    if (rank() == 0 && !module.empty())
      write_module_file(p->tmp, module, p->m.save_id, tensor_names(p->m.units));
    if (shard_group().index != 0) return;  // another group writes the same shards
    frozen = impl_->state->snapshot();
    write_files(*p, shard_group().rank, RangeSource(*p, impl_->state.get(), frozen.get()));
  });
  return finish(*this, *p, written);
}

void Engine::save_async(const std::filesystem::path& root, const std::string& tag,
                        const ModuleState& module) {
  if (!impl_->finalized)
    ZS_THROW(invalid_argument, "rank " << rank() << ": save_async(" << root.string()
                                       << ") before finalize(): there is no state to save yet");
  impl_->check_state("save_async");
  finish_save();
  std::shared_ptr<PendingSave> p = start(*this, root, tag);
  // The snapshot: kept by the tier where the state lies (nvme), else this rank's data files'
  // contents copied into host memory, state after state. Where the tier stores every state in
  // host memory the save's thread makes that copy, while the trainer goes on (its forward and
  // backward change neither the master weights nor the moments): the next change of the state
  // waits for it (Impl::before_state_change()). Else (a GPU's memory) it is made now. Every rank
  // learns whether every rank took its snapshot or has its buffer (a rank that cannot must not
  // leave the others training while it waits in this save's agreement).
  std::unique_ptr<StateSnapshot> frozen;
  char* copied = nullptr;
  std::vector<size_t> starts;  // of each state's contents in `copied`
  bool in_thread = true;       // the save's thread copies
  bool fresh = false;          // the snapshot's pages are to be faulted in before the copy
  const int r = shard_group().rank;
  const bool writes = shard_group().index == 0;  // the other groups hold the same shards
  StateTier* tier = impl_->state.get();
  // Copies this rank's data files' contents into `copied`, from the tier.
  auto copy = [raw = p.get(), r, tier](char* into, const std::vector<size_t>& at0) {
    RangeSource source(*raw, tier, nullptr);
    for (size_t i = 0; i < raw->states.size(); ++i) {
      size_t at = at0[i];
      for (const Range& rg : raw->m.ranges[size_t(r)]) {
        const size_t n =
            size_t(encoded_bytes(encoding_of(raw->m, raw->states[i]), rg.end - rg.begin));
        std::memcpy(into + at, source(i, rg), n);
        at += n;
      }
    }
  };
  try {
    all_or_none(*communicator(), p->at + ": snapshot", [&] {
      if (!writes) return;
      frozen = impl_->state->snapshot();
      if (frozen) return;
      const size_t total = snapshot_bytes(p->m, p->states, r, &starts);
      for (int s : p->states)
        for (const Range& rg : p->m.ranges[size_t(r)])
          in_thread &= tier->stored(rg.unit, state_names()[size_t(s)].kind).data != nullptr;
      if (impl_->save.snapshot.bytes() != total) {
        impl_->save.faulting = {};  // joined: it faults in the buffer about to go
        impl_->save.snapshot = Buffer();
        impl_->save.snapshot =
            Buffer(&impl_->res.ledger, Tier::host, MemKind::buffer, "checkpoint_snapshot", total);
        impl_->save.faulted = false;
      }
      copied = impl_->save.snapshot.as<char>();
      fresh = !impl_->save.faulted;
      if (!in_thread) {
        if (impl_->save.faulting.joinable()) impl_->save.faulting.join();
        if (fresh) impl_->save.snapshot.populate();
        copy(copied, starts);
      }
    });
  } catch (const Error&) {
    std::error_code ec;
    if (rank() == 0) fs::remove_all(p->tmp, ec);
    throw;
  }
  if (copied) impl_->save.faulted = true;  // by the copy made, or the writer's
  if (rank() == 0) p->module = module;
  PendingSave* raw = p.get();
  if (!writes) {
    impl_->save.pending = std::move(p);
    return;
  }
  std::shared_ptr<CopyGate> gate;
  if (copied && in_thread) gate = std::make_shared<CopyGate>();
  Buffer* snapshot = &impl_->save.snapshot;  // outlives the thread: finish_save() joins it first
  // A thread that cannot start leaves p->writer empty: finish_save() then reports it.
  try {
    const GiveWay give_way{&impl_->stepping, &p->hurry};
    p->writer = std::thread([raw, r, copied, snapshot, starts, gate, copy, fresh, give_way,
                             faulting = std::move(impl_->save.faulting),
                             frozen = std::move(frozen)]() mutable {
      // The trainer first: this thread and the writers it starts (which inherit it) take
      // the cores the trainer leaves (Linux: a nice value is per thread).
      (void)::setpriority(PRIO_PROCESS, 0, 19);
      raw->error = outcome([&] {
        if (frozen) {
          write_files(*raw, r, RangeSource(*raw, nullptr, frozen.get()));
        } else {
          if (gate) {
            struct Open {  // however the copy ends: the trainer must not wait forever
              CopyGate& g;
              ~Open() { g.open(); }
            } open{*gate};
            // A new snapshot's pages in one call first: faulted one by one by the copy they
            // cost 3× the copy, all of it the trainer's wait. One that finalize() made is
            // faulted in by its own thread (joined here), and a kept one is already (a walk
            // over its pages would still cost a third of the copy).
            if (faulting.joinable()) faulting.join();
            if (fresh) snapshot->populate();
            copy(copied, starts);
          }
          std::vector<size_t> at = starts;
          write_files(
              *raw, r,
              [&](size_t i, const Range& rg) -> const char* {
                const char* v = copied + at[i];
                at[i] +=
                    size_t(encoded_bytes(encoding_of(raw->m, raw->states[i]), rg.end - rg.begin));
                return v;
              },
              give_way);
        }
        if (!raw->module.empty())
          write_module_file(raw->tmp, raw->module, raw->m.save_id, tensor_names(raw->m.units));
      });
      frozen.reset();  // the tier may write over what it kept
    });
    impl_->save.copying = std::move(gate);
  } catch (const std::system_error& e) {
    impl_->save.faulted = false;  // nothing copied
    p->error = Error(ErrorCode::internal, p->at + ": cannot start its writer thread: " + e.what());
  }
  impl_->save.pending = std::move(p);
}

std::filesystem::path Engine::finish_save() {
  if (!impl_->save.pending) return {};
  std::shared_ptr<PendingSave> p = std::static_pointer_cast<PendingSave>(impl_->save.pending);
  impl_->save.pending.reset();
  p->hurry = true;
  if (p->writer.joinable()) p->writer.join();
  impl_->save.copying.reset();
  return finish(*this, *p, p->error);
}

void Engine::Impl::reserve_snapshot(Engine& e) {
  // The nvme tier keeps its snapshot in its swap files; the other groups do not write.
  if (!cfg.checkpoint_async || cfg.offload_optimizer.tier == Tier::nvme ||
      e.shard_group().index != 0)
    return;
  std::vector<int> states;
  const size_t total = snapshot_bytes(describe(e, states), states, e.shard_group().rank);
  try {
    save.snapshot = Buffer(&res.ledger, Tier::host, MemKind::buffer, "checkpoint_snapshot", total);
  } catch (const std::exception& err) {
    // The first save_async() tries again, and fails there on every rank alike (all_or_none).
    std::fprintf(stderr, "zeroshard: rank %d: checkpoint_async: no snapshot made now: %s\n", rank,
                 err.what());
    return;
  }
  if (save.snapshot.empty()) return;  // a plan counts it, and allocates nothing
  try {
    // 64 MiB at a time: the address space is not held for the whole buffer in one call, and an
    // engine destroyed (or a snapshot remade) meanwhile stops it between two.
    save.faulting = std::jthread([snapshot = &save.snapshot](std::stop_token stop) {
      (void)::setpriority(PRIO_PROCESS, 0, 19);  // the trainer first, as the save's threads
      constexpr size_t kChunk = size_t(64) << 20;
      for (size_t at = 0; at < snapshot->bytes() && !stop.stop_requested(); at += kChunk)
        snapshot->populate(at, kChunk);
    });
    save.faulted = true;
  } catch (const std::system_error&) {
    // No thread: the first save_async() faults the snapshot in, as without checkpoint_async.
  }
}

}  // namespace zeroshard
