// The engine's nvme tier under faults, on every rank at once: EIO and short transfers through
// the I/O seam, a full disk for real (a tmpfs mounted by the test: as root, like CI), swap files
// truncated or corrupted behind the engine's back, and paths that do not exist or are read-only.
// After each, every rank throws a clear error naming the path, the unit and the operation, and
// no step is half applied: parameters and optimizer state are bitwise those of the last
// completed step, and (where the disk recovers) retrying the step gives bitwise the result of
// a run that never failed.
#include <fcntl.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/mount.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <optional>

#include "tests/fault/fault_backend.hpp"
#include "tests/multirank/harness.hpp"

using namespace zeroshard;
using ::testing::HasSubstr;
using zs_test::world;
namespace fs = std::filesystem;

namespace {

// ---- helpers
// -------------------------------------------------------------------------------------

// A tmpfs of `size` mounted at a fresh directory for this rank; unmounted at destruction.
class Tmpfs {
 public:
  Tmpfs(const std::string& size, bool read_only = false) {
    char tmpl[] = "/tmp/zeroshard-fault-XXXXXX";
    if (!::mkdtemp(tmpl)) return;
    dir_ = tmpl;
    const std::string opts = "size=" + size + ",mode=0755";
    if (::mount("tmpfs", dir_.c_str(), "tmpfs", read_only ? MS_RDONLY : 0, opts.c_str()) == 0)
      mounted_ = true;
  }
  ~Tmpfs() {
    if (mounted_) ::umount2(dir_.c_str(), MNT_DETACH);
    if (!dir_.empty()) ::rmdir(dir_.c_str());
  }
  bool ok() const { return mounted_; }
  const fs::path& dir() const { return dir_; }

 private:
  fs::path dir_;
  bool mounted_ = false;
};

// Every rank must agree to skip, or the ranks that go on would wait for the others.
bool all_ranks(bool ok) {
  double v = ok ? 0 : 1;
  world()->all_reduce(&v, 1, ReduceOp::max, "skip check")->wait();
  return v == 0;
}

fs::path swap_root() {
  fs::path p = fs::temp_directory_path() / "zeroshard-fault-tests";
  fs::create_directories(p / "a");
  fs::create_directories(p / "b");
  return p;
}

Config nvme_config(int stage, bool params_too, const std::vector<std::string>& paths) {
  Config cfg;
  cfg.stage = stage;
  cfg.dtype = DType::bf16;
  cfg.gradient_clipping = 1.0;
  cfg.optimizer.kind = OptimizerKind::adamw;
  cfg.optimizer.lr = 1e-2f;
  cfg.shard_alignment = 4;
  cfg.collective_timeout_s = 60;
  cfg.offload_optimizer.tier = Tier::nvme;
  cfg.offload_optimizer.nvme_paths = paths;
  cfg.offload_optimizer.buffer_count = 3;
  if (params_too) {
    cfg.offload_param.tier = Tier::nvme;
    cfg.offload_param.nvme_paths = paths;
    cfg.offload_param.buffer_count = 2;
  }
  cfg.aio.block_size = 4096;
  cfg.aio.queue_depth = 4;
  return cfg;
}

Config default_config(int stage, bool params_too) {
  const fs::path r = swap_root();
  return nvme_config(stage, params_too, {(r / "a").string(), (r / "b").string()});
}

std::vector<zs_test::UnitSpec> model() {
  auto m = zs_test::uneven_model();
  m.push_back({"wide", {{"w", {40, 97}}}});
  return m;
}

struct State {
  std::vector<std::vector<float>> v;  // per unit: param, master, m, v
  bool operator==(const State& o) const {
    if (v.size() != o.v.size()) return false;
    for (size_t i = 0; i < v.size(); ++i)
      if (v[i].size() != o.v[i].size() ||
          std::memcmp(v[i].data(), o.v[i].data(), v[i].size() * 4) != 0)
        return false;
    return true;
  }
};

State snapshot(Engine& e) {
  State s;
  for (int u = 0; u < e.num_units(); ++u)
    for (StateKind k : {StateKind::param, StateKind::master, StateKind::state0, StateKind::state1})
      s.v.push_back(e.read_shard(u, k));
  return s;
}

// One training step with the harness's synthetic gradients for step index `step`;
// `before_step` runs between the backward pass and step().
StepResult train_step(Engine& e, int step, const std::function<void()>& before_step = {}) {
  for (int u = 0; u < e.num_units(); ++u) {
    std::vector<TensorView> p = e.gather(u);
    std::vector<TensorView> g = e.grads(u);
    int64_t flat = 0;
    for (size_t t = 0; t < p.size(); ++t)
      for (int64_t i = 0; i < p[t].numel; ++i, ++flat)
        zs_test::store(g[t].data, g[t].dtype, i,
                       zs_test::synthetic_grad(zs_test::load(p[t].data, p[t].dtype, i), u, flat,
                                               e.rank(), 0, step));
    e.grads_ready(u);
    e.release(u);
  }
  if (before_step) before_step();
  return e.step();
}

// Runs `stmt`, expects Error(code) on this rank, and returns its message.
template <class F>
std::string expect_error(F&& f, ErrorCode code) {
  try {
    f();
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), code) << e.what();
    return e.what();
  } catch (const std::exception& e) {
    ADD_FAILURE() << "threw something other than zeroshard::Error: " << e.what();
    return {};
  }
  ADD_FAILURE() << "no error was thrown";
  return {};
}

bool failing_rank() {
  return world()->rank() == world()->size() - 1;
}

// Checks a failed step's message on every rank: the failing rank names path, unit and
// operation; the others name the failing rank; all say the step was not applied.
void expect_step_message(const std::string& msg, const std::string& op_text) {
  EXPECT_THAT(msg, HasSubstr("was not applied on any rank"));
  EXPECT_THAT(msg, HasSubstr("unit '"));
  EXPECT_THAT(msg, HasSubstr(op_text));
  EXPECT_THAT(msg, HasSubstr(".swap"));
  if (!failing_rank()) {
    EXPECT_THAT(msg, HasSubstr("failed on rank " + std::to_string(world()->size() - 1)));
  }
}

// Muon on the nvme tier: a unit's update waits for its matrices' exchange with every rank, so a
// rank whose I/O fails part way must still take part in the exchanges left, or the others hang
// in them. The step fails on every rank with the failing rank named and is not applied; once
// the disk is healthy the step gives what a run without the fault gives.
TEST(EngineFaults, EioInAMuonStepFailsOnEveryRankWithoutHanging) {
  const std::vector<zs_test::UnitSpec> muon_model = {
      {"embed", {{"w", {37, 11}}}},
      {"layer0", {{"w", {11, 23}}, {"b", {23}}}},
      {"wide", {{"w", {40, 97}}, {"b2", {97}}}},
  };
  Config cfg = default_config(2, false);
  cfg.optimizer.kind = OptimizerKind::muon;
  cfg.optimizer.lr = 2e-2f;
  cfg.optimizer.momentum = 0.95f;
  cfg.optimizer.nesterov = true;
  OptimizerOptions adamw;
  adamw.lr = 1e-2f;
  for (int fail_read : {0, 1}) {
    SCOPED_TRACE(fail_read ? "a read fails" : "a write fails");
    auto plan = std::make_shared<zs_fault::FaultPlan>();
    zs_fault::InjectFaults inject(plan);
    Engine e(cfg, world()), ref(cfg, world());
    e.add_group(adamw);
    ref.add_group(adamw);
    zs_test::register_model(e, muon_model, 1);
    zs_test::register_model(ref, muon_model, 1);
    for (int s = 0; s < 3; ++s) {
      train_step(e, s);
      train_step(ref, s);
    }
    const State before = snapshot(e);
    (fail_read ? plan->fail_read_at : plan->fail_write_at) = 1;  // the first units exchanged
    const std::string msg = expect_error(
        [&] { train_step(e, 3, [&] { plan->armed = failing_rank(); }); }, ErrorCode::io_error);
    EXPECT_THAT(msg, HasSubstr("was not applied on any rank"));
    if (failing_rank()) {
      EXPECT_GT(plan->injected.load(), 0);
    }
    plan->armed = false;
    EXPECT_EQ(e.step_count(), 3);
    EXPECT_TRUE(snapshot(e) == before) << "a failed step changed the state";
    train_step(e, 3);
    train_step(ref, 3);
    EXPECT_TRUE(snapshot(e) == snapshot(ref)) << "retrying the step did not give the clean result";
  }
}

// ---- EIO and short transfers through the seam
// --------------------------------------------------------

// A write fails in the middle of step 4 on the last rank. Every rank throws; the state (read
// back from memory and disk) is bitwise that of step 3; retrying step 4 once the fault is gone
// gives bitwise what a run without the fault has. Stages 2 (parameters whole in memory, rolled
// back) and 3 (parameters on nvme, never touched).
TEST(EngineFaults, EioInTheMiddleOfAStepLeavesTheLastStep) {
  for (int stage : {2, 3}) {
    for (bool params_too : {false, true}) {
      if (stage < 3 && params_too) continue;
      SCOPED_TRACE("stage " + std::to_string(stage) + (params_too ? " params on nvme" : ""));
      auto plan = std::make_shared<zs_fault::FaultPlan>();
      zs_fault::InjectFaults inject(plan);
      Engine e(default_config(stage, params_too), world()),
          ref(default_config(stage, params_too), world());
      zs_test::register_model(e, model());
      zs_test::register_model(ref, model());
      for (int s = 0; s < 4; ++s) {
        train_step(e, s);
        train_step(ref, s);
      }
      const State before = snapshot(e);
      plan->fail_write_at = 9;  // a few units into the step's pipeline: some were already updated
      std::string msg = expect_error(
          [&] { train_step(e, 4, [&] { plan->armed = failing_rank(); }); }, ErrorCode::io_error);
      expect_step_message(msg, "write");
      if (failing_rank()) {
        EXPECT_THAT(msg, HasSubstr("Input/output error (EIO)"));
        EXPECT_GT(plan->injected.load(), 0);
      }
      plan->armed = false;
      EXPECT_EQ(e.step_count(), 4);
      EXPECT_TRUE(snapshot(e) == before) << "a failed step changed the state";
      // The disk is healthy again: the same step now succeeds, as if nothing happened.
      train_step(e, 4);
      train_step(ref, 4);
      train_step(e, 5);
      train_step(ref, 5);
      EXPECT_TRUE(snapshot(e) == snapshot(ref))
          << "retrying the step did not give the clean result";
      EXPECT_FALSE(snapshot(e) == before);
    }
  }
}

// The speculative step on the nvme tier: a read or write of a unit's speculation fails on the
// last rank during backward. Speculation is only ahead of time: that unit's speculation is
// dropped, the step updates it as usual (its own I/O healthy), and the result is bitwise that of
// an engine without speculation. The gradient cache holds every unit, so the only I/O during
// backward is the speculations', and all of it comes before the step's own.
TEST(EngineFaults, EioInASpeculationLeavesItToTheStep) {
  for (bool fail_read : {false, true}) {
    SCOPED_TRACE(fail_read ? "a speculation's read fails" : "a speculation's write fails");
    auto plan = std::make_shared<zs_fault::FaultPlan>();
    zs_fault::InjectFaults inject(plan);
    Config cfg = default_config(2, false);
    cfg.grad_buffers = 8;
    cfg.gradient_clipping = 0;  // a clipped step keeps no speculation
    Config spec = cfg;
    spec.speculative_step = SpeculativeStep::on;
    Engine e(spec, world()), ref(cfg, world());
    zs_test::register_model(e, model());
    zs_test::register_model(ref, model());
    for (int s = 0; s < 2; ++s) {
      train_step(e, s);
      train_step(ref, s);
    }
    (fail_read ? plan->fail_read_at : plan->fail_write_at) = 0;
    plan->armed = failing_rank();
    const StepResult r = train_step(e, 2);
    plan->armed = false;
    train_step(ref, 2);
    EXPECT_FALSE(r.skipped);
    EXPECT_EQ(r.speculation_kept + r.speculation_dropped, e.num_units());
    if (failing_rank()) {
      EXPECT_GT(plan->injected.load(), 0);
      EXPECT_GE(r.speculation_dropped, 1);
    } else {
      EXPECT_EQ(r.speculation_kept, e.num_units());
    }
    EXPECT_TRUE(snapshot(e) == snapshot(ref)) << "a failed speculation changed the step";
    train_step(e, 3);
    train_step(ref, 3);
    EXPECT_TRUE(snapshot(e) == snapshot(ref));
  }
}

// Short transfers (real and misaligned), EAGAIN and EINTR all the way through training: the
// results are bitwise those of the device tier.
TEST(EngineFaults, ShortTransfersAndTransientErrorsKeepParity) {
  auto plan = std::make_shared<zs_fault::FaultPlan>();
  plan->short_aligned = true;
  plan->short_misaligned = true;
  plan->transient_every = 5;
  plan->armed = true;
  zs_fault::InjectFaults inject(plan);
  Config cfg = default_config(3, true);
  cfg.aio.block_size = 16384;  // requests above 4 KiB, so short transfers happen
  Engine e(cfg, world());
  Config dev = cfg;
  dev.offload_optimizer.tier = Tier::device;
  dev.offload_param.tier = Tier::device;
  Engine ref(dev, world());
  zs_test::register_model(e, model());
  zs_test::register_model(ref, model());
  for (int s = 0; s < 6; ++s) {
    train_step(e, s);
    train_step(ref, s);
  }
  EXPECT_TRUE(snapshot(e) == snapshot(ref));
  EXPECT_GT(plan->injected.load(), 10);
  EXPECT_GT(e.swap_stats().resubmitted, 10);
}

// A read of a parameter shard fails during gather() on the last rank: every rank's gather()
// throws (no rank waits in the all-gather), and gathering again once the fault is gone works.
TEST(EngineFaults, ParameterReadFailureFailsGatherOnEveryRank) {
  auto plan = std::make_shared<zs_fault::FaultPlan>();
  zs_fault::InjectFaults inject(plan);
  Config cfg = default_config(3, true);
  cfg.prefetch = false;  // the failing read is the one gather() itself issues
  Engine e(cfg, world());
  zs_test::register_model(e, model());
  train_step(e, 0);
  const State before = snapshot(e);
  plan->fail_read_at = 0;
  plan->armed = failing_rank();
  std::string msg = expect_error([&] { e.gather(2); }, ErrorCode::io_error);
  if (failing_rank()) {
    EXPECT_THAT(msg, HasSubstr("read of unit 'layer1' (parameters"));
    EXPECT_THAT(msg, HasSubstr("param.swap failed: Input/output error (EIO)"));
  } else {
    EXPECT_THAT(msg, HasSubstr("gather() of unit 'layer1' failed on rank " +
                               std::to_string(world()->size() - 1)));
  }
  EXPECT_THAT(msg, HasSubstr("the parameters on disk are those of the last completed step"));
  plan->armed = false;
  std::vector<TensorView> v = e.gather(2);
  EXPECT_EQ(v.size(), 3u);
  e.release(2);
  EXPECT_TRUE(snapshot(e) == before);
}

// ---- the files, behind the engine's back
// -------------------------------------------------------------

// Flip one byte per 4 KiB in the second half of the last rank's optimizer file: some unit's
// read fails its checksum. Every rank throws; parameters are rolled back everywhere.
TEST(EngineFaults, CorruptedSwapFileIsDetectedAndNothingIsApplied) {
  Engine e(default_config(2, false), world());
  zs_test::register_model(e, model());
  for (int s = 0; s < 2; ++s) train_step(e, s);
  const State before = snapshot(e);
  if (failing_rank()) {
    for (const std::string& f : e.swap_files()) {
      if (f.find("optim.swap") == std::string::npos) continue;
      const auto size = fs::file_size(f);
      int fd = ::open(f.c_str(), O_RDWR);
      ASSERT_GE(fd, 0);
      for (off_t o = off_t(size / 2) / 4096 * 4096; o < off_t(size); o += 4096) {
        char b = 0;
        ASSERT_EQ(::pread(fd, &b, 1, o + 100), 1);
        b = char(~b);
        ASSERT_EQ(::pwrite(fd, &b, 1, o + 100), 1);
      }
      ::close(fd);
    }
  }
  std::string msg = expect_error([&] { train_step(e, 2); }, ErrorCode::corrupted);
  expect_step_message(msg, "read");
  if (failing_rank()) {
    EXPECT_THAT(msg, HasSubstr("checksum mismatch"));
  }
  EXPECT_EQ(e.step_count(), 2);
  // Parameters in memory are those of step 2 on every rank; the optimizer state of ranks whose
  // files are intact too (the damaged rank's state is lost, and says so when read).
  for (int u = 0; u < e.num_units(); ++u) {
    const auto p = e.read_shard(u, StateKind::param);
    EXPECT_EQ(0, std::memcmp(p.data(), before.v[size_t(4 * u)].data(), p.size() * 4))
        << "unit " << u;
  }
  if (!failing_rank()) {
    EXPECT_TRUE(snapshot(e) == before);
  }
}

TEST(EngineFaults, TruncatedSwapFileIsDetected) {
  Engine e(default_config(3, true), world());
  zs_test::register_model(e, model());
  train_step(e, 0);
  const State before = snapshot(e);
  // Truncated after the backward pass (whose gradient evictions would write the file longer
  // again, leaving holes: those fail their checksums instead, as the test above shows).
  auto truncate = [&] {
    if (failing_rank())
      for (const std::string& f : e.swap_files())
        if (f.find("optim.swap") != std::string::npos) fs::resize_file(f, 0);
  };
  std::string msg = expect_error([&] { train_step(e, 1, truncate); }, ErrorCode::corrupted);
  expect_step_message(msg, "read");
  if (failing_rank()) {
    EXPECT_THAT(msg, HasSubstr("truncated"));
  }
  EXPECT_EQ(e.step_count(), 1);
  if (!failing_rank()) {
    EXPECT_TRUE(snapshot(e) == before);
  }
}

// ---- a full disk, for real
// ----------------------------------------------------------------------------

// The last rank's path is a 256 KiB tmpfs: the swap files cannot be reserved. Every rank fails
// in finalize() naming the failing rank and the path, and nothing is left on the tmpfs.
TEST(EngineFaults, FullDiskAtFinalizeNamesThePath) {
  Tmpfs small("256k");
  if (!all_ranks(small.ok())) GTEST_SKIP() << "mounting a tmpfs needs root (CI runs as root)";
  const fs::path r = swap_root();
  std::vector<std::string> paths = {(r / "a").string()};
  if (failing_rank()) paths = {small.dir().string()};
  Engine e(nvme_config(2, false, paths), world());
  e.add_unit("big", {Param{"w", {300000}}});
  std::string msg = expect_error([&] { e.finalize(); }, ErrorCode::no_space);
  EXPECT_THAT(msg, HasSubstr("No space left on device"));
  EXPECT_THAT(msg, HasSubstr("optim.swap"));
  if (failing_rank()) {
    EXPECT_THAT(msg, HasSubstr(small.dir().string()));
  } else {
    EXPECT_THAT(msg, HasSubstr("finalize() failed on rank " + std::to_string(world()->size() - 1)));
  }
  EXPECT_TRUE(fs::is_empty(small.dir())) << "a failed finalize() left files behind";
}

// Sparse swap files (as on a file system without fallocate) on a tmpfs that another writer fills
// right after finalize(): the first step's writes (gradient evictions, second record slots) find
// no room. Every rank throws no_space naming the file and unit; the state is that of
// finalize(); once the space is freed, the step succeeds with bitwise the clean result.
TEST(EngineFaults, DiskFullDuringAStepLeavesTheLastStep) {
  Tmpfs disk("2m");
  if (!all_ranks(disk.ok())) GTEST_SKIP() << "mounting a tmpfs needs root (CI runs as root)";
  Engine e(nvme_config(3, true, {disk.dir().string()}), world());
  {
    zs_fault::InjectFaults sparse(std::make_shared<zs_fault::FaultPlan>(), /*preallocate=*/false);
    zs_test::register_model(e, model());  // the swap files are made in finalize()
  }
  Engine ref(default_config(3, true), world());
  zs_test::register_model(ref, model());
  const State before = snapshot(e);
  const fs::path filler = disk.dir() / "filler";
  if (failing_rank()) {
    std::ofstream f(filler, std::ios::binary);
    std::vector<char> chunk(4096, 'x');
    while (f.write(chunk.data(), std::streamsize(chunk.size())) && f.flush()) {
    }
  }
  std::string msg = expect_error([&] { train_step(e, 0); }, ErrorCode::no_space);
  expect_step_message(msg, "write");
  if (failing_rank()) {
    EXPECT_THAT(msg, HasSubstr("No space left on device (ENOSPC)"));
  }
  EXPECT_EQ(e.step_count(), 0);
  EXPECT_TRUE(snapshot(e) == before);
  if (failing_rank()) fs::remove(filler);
  for (int s = 0; s < 2; ++s) {
    train_step(e, s);
    train_step(ref, s);
  }
  EXPECT_TRUE(snapshot(e) == snapshot(ref));
}

// ---- paths that cannot be used
// -------------------------------------------------------------------------

TEST(EngineFaults, ReadOnlyPathFailsFinalizeOnEveryRank) {
  Tmpfs ro("64k", /*read_only=*/true);
  if (!all_ranks(ro.ok())) GTEST_SKIP() << "mounting a tmpfs needs root (CI runs as root)";
  const fs::path r = swap_root();
  std::vector<std::string> paths = {(r / "a").string()};
  if (failing_rank()) paths = {ro.dir().string()};
  Engine e(nvme_config(2, false, paths), world());
  e.add_unit("u", {Param{"w", {100}}});
  std::string msg = expect_error([&] { e.finalize(); }, ErrorCode::io_error);
  EXPECT_THAT(msg, HasSubstr("Read-only file system"));
  if (failing_rank()) {
    EXPECT_THAT(msg, HasSubstr("nvme path '" + ro.dir().string() + "' is not writable"));
  } else {
    EXPECT_THAT(msg, HasSubstr("finalize() failed on rank " + std::to_string(world()->size() - 1)));
    EXPECT_THAT(msg, HasSubstr("' is not writable"));
  }
}

}  // namespace
