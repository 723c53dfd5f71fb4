// Bad input gets a clear error on every rank, never a hang or silent damage.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <string>
#include <thread>
#include <vector>

#include "tests/multirank/harness.hpp"

using namespace zeroshard;
using ::testing::HasSubstr;
using zs_test::world;

namespace {

// Rank 1 registers layer1.w with another shape: every rank fails, naming unit and shapes.
TEST(ModelCheck, DifferentShapeFailsOnEveryRank) {
  if (world()->size() < 2) GTEST_SKIP() << "needs 2 or more ranks (runs under mpirun -np 2..4)";
  Engine e(Config{}, world());
  auto model = zs_test::uneven_model();
  if (world()->rank() == 1) model[2].params[0].second = {23, 14};
  for (auto& u : model) {
    std::vector<Param> ps;
    for (auto& [n, s] : u.params) ps.push_back({n, s});
    e.add_unit(u.name, ps);
  }
  EXPECT_ZS_ERROR(e.finalize(), model_mismatch, "unit 'layer1'");
  try {
    e.finalize();
  } catch (const Error& err) {
    // Second call: already-failed engines still refuse cleanly (no collective, no hang).
    (void)err;
  }
}

TEST(ModelCheck, MessageNamesBothShapesAndRanks) {
  if (world()->size() < 2) GTEST_SKIP() << "needs 2 or more ranks (runs under mpirun -np 2..4)";
  Engine e(Config{}, world());
  std::vector<int64_t> shape = world()->rank() == world()->size() - 1 ? std::vector<int64_t>{4, 6}
                                                                      : std::vector<int64_t>{4, 5};
  e.add_unit("only", {Param{"w", shape}});
  try {
    e.finalize();
    ADD_FAILURE() << "finalize() accepted different models";
  } catch (const Error& err) {
    std::string m = err.what();
    EXPECT_THAT(m, HasSubstr("[4, 5]"));
    EXPECT_THAT(m, HasSubstr("[4, 6]"));
    EXPECT_THAT(m, HasSubstr("rank " + std::to_string(world()->size() - 1) +
                             " registered a different model"));
  }
}

TEST(ModelCheck, DifferentOrderFails) {
  if (world()->size() < 2) GTEST_SKIP() << "needs 2 or more ranks (runs under mpirun -np 2..4)";
  Engine e(Config{}, world());
  std::vector<std::string> names = {"a", "b"};
  if (world()->rank() == 1) std::swap(names[0], names[1]);
  for (auto& n : names) e.add_unit(n, {Param{"w", {3}}});
  EXPECT_ZS_ERROR(e.finalize(), model_mismatch, "rank 0 has \"unit 'a'\"");
}

// Ranks that start from different initial values (a seed that differs per rank) would train
// different models in lockstep, each update averaging gradients of different points.
TEST(ModelCheck, DifferentInitialValuesFail) {
  if (world()->size() < 2) GTEST_SKIP() << "needs 2 or more ranks (runs under mpirun -np 2..4)";
  Engine e(Config{}, world());
  std::vector<float> w = {1, 2, 3}, b = {4, 5, 6};
  if (world()->rank() == 1) b[2] = 6.5f;
  e.add_unit("a", {Param{"w", {3}, 0, {w.data(), 3}}});
  e.add_unit("b", {Param{"w", {3}, 0, {b.data(), 3}}});
  EXPECT_ZS_ERROR(e.finalize(), model_mismatch, "first difference in unit 'b'");
}

TEST(ModelCheck, SameInitialValuesPass) {
  Engine e(Config{}, world());
  std::vector<float> w = {1, 2, 3};
  e.add_unit("a", {Param{"w", {3}, 0, {w.data(), 3}}});
  e.finalize();
  EXPECT_EQ(e.read_shard(0, StateKind::master).size(), e.shard_info(0).shard_numel);
}

TEST(ModelCheck, DifferentDtypeFails) {
  if (world()->size() < 2) GTEST_SKIP() << "needs 2 or more ranks (runs under mpirun -np 2..4)";
  Config cfg;
  cfg.dtype = world()->rank() == 1 ? DType::bf16 : DType::f32;
  Engine e(cfg, world());
  e.add_unit("a", {Param{"w", {3}}});
  EXPECT_ZS_ERROR(e.finalize(), model_mismatch, "dtype=bf16");
}

// Settings that change the sequence of collectives are part of the model check too: a rank that
// prefetches (stage 3: the next unit's all-gather is issued early) and one that does not would
// pass finalize() and then issue their all-gathers out of step. Every rank fails instead, and
// the message names the setting with both values.
TEST(ModelCheck, DifferentPrefetchFailsOnEveryRankNamingIt) {
  if (world()->size() < 2) GTEST_SKIP() << "needs 2 or more ranks (runs under mpirun -np 2..4)";
  Config cfg;
  cfg.stage = 3;
  cfg.prefetch = world()->rank() != world()->size() - 1;
  Engine e(cfg, world());
  e.add_unit("a", {Param{"w", {3}}});
  e.add_unit("b", {Param{"w", {5}}});
  const std::string last = std::to_string(world()->size() - 1);
  EXPECT_ZS_ERROR(e.finalize(), model_mismatch,
                  "rank " + last +
                      " registered a different model than rank 0: first difference in the "
                      "configuration: rank 0 has \"config prefetch=true\", rank " +
                      last + " has \"config prefetch=false\"");
}

// The same for two more settings the old check left out, each in turn.
TEST(ModelCheck, DifferentMaxLiveUnitsOrOverlapCommFails) {
  if (world()->size() < 2) GTEST_SKIP() << "needs 2 or more ranks (runs under mpirun -np 2..4)";
  for (const char* setting : {"max_live_units", "overlap_comm"}) {
    Config cfg;
    cfg.stage = 3;
    if (world()->rank() == 1) {
      if (std::string(setting) == "max_live_units") cfg.max_live_units = 4;
      if (std::string(setting) == "overlap_comm") cfg.overlap_comm = false;
    }
    Engine e(cfg, world());
    e.add_unit("a", {Param{"w", {3}}});
    EXPECT_ZS_ERROR(e.finalize(), model_mismatch, std::string("config ") + setting + "=");
  }
}

// A collective that a peer never joins in time fails with an error naming it and the unit.
// The late rank arrives after the timeout, completing the abandoned collective, so the process
// still ends cleanly.
TEST(Timeout, LateRankFailsTheCollectiveNamingTheUnit) {
  if (world()->size() < 2) GTEST_SKIP() << "needs 2 or more ranks (runs under mpirun -np 2..4)";
  auto comm = make_mpi_communicator();  // its own: a timed-out communicator refuses further work
  Config cfg;
  cfg.stage = 2;
  cfg.collective_timeout_s = 0.5;
  {
    Engine e(cfg, comm);
    e.add_unit("late_unit", {Param{"w", {64}}});
    e.finalize();
    if (comm->rank() == 0) {
      e.grads(0);
      e.grads_ready(0);
      EXPECT_ZS_ERROR(e.step(), timeout, "reduce_scatter of unit 'late_unit'");
      double x = 0;
      EXPECT_ZS_ERROR(comm->all_reduce(&x, 1, ReduceOp::sum, "after")->wait(), comm_failure,
                      "unusable");
    } else {
      std::this_thread::sleep_for(std::chrono::milliseconds(1500));
      e.grads(0);
      e.grads_ready(0);
      e.zero_grad();  // waits for the reduction, which rank 0's abandoned request completes
    }
    // Rank 0's engine must outlive the late reduction that still writes into its buffers; its
    // destructor waits for that to settle once every rank has joined.
    world()->barrier("after timeout test");
  }
}

// A peer that stops answering (here stopped by SIGSTOP: its process, communication thread
// included, runs nothing, as when its host is cut off) is named with its host by the ranks whose
// collective times out; a peer that is merely late still answers, and the error says so.
TEST(Timeout, NamesThePeerThatStopsAnswering) {
  if (world()->size() < 2) GTEST_SKIP() << "needs 2 or more ranks (runs under mpirun -np 2..4)";
  const int rank = world()->rank(), last = world()->size() - 1;
  std::vector<double> pids(size_t(world()->size()), 0.0);
  pids[size_t(rank)] = double(getpid());
  world()->all_reduce(pids.data(), int64_t(pids.size()), ReduceOp::sum, "pids")->wait();

  {  // Late: the last rank arrives after the timeout, its communication thread running (and
     // answering within the probe's window, the last quarter of the timeout: 0.5 s here).
    auto comm = make_mpi_communicator();
    comm->set_timeout(2.0);
    double x = 1;
    if (rank == last) {
      std::this_thread::sleep_for(std::chrono::milliseconds(3000));
      comm->all_reduce(&x, 1, ReduceOp::sum, "late norm")->wait();  // completes the others'
    } else {
      EXPECT_ZS_ERROR(comm->all_reduce(&x, 1, ReduceOp::sum, "late norm")->wait(), timeout,
                      "every other rank still answers");
    }
    world()->barrier("after the late rank");
  }
  {  // Stopped: nothing of the last rank runs until rank 0 wakes it.
    auto comm = make_mpi_communicator();
    comm->set_timeout(2.0);
    double x = 1;
    // First a collective that is slow but completes: the others' probe of its last quarter
    // (from 1.5 s) is answered. That answer must not speak for the collective below.
    if (rank == last) std::this_thread::sleep_for(std::chrono::milliseconds(1600));
    comm->all_reduce(&x, 1, ReduceOp::sum, "a slow sum")->wait();
    // The ranks that stay running, so that rank 0 wakes the stopped one only after every one
    // of them has had its error (woken earlier, it would answer a later rank's probe).
    std::vector<int> running(static_cast<size_t>(last));
    for (int q = 0; q < last; ++q) running[size_t(q)] = q;
    auto others = world()->split(rank == last ? std::vector<int>{last} : running, "running");
    world()->barrier("before the stop");
    if (rank == last) {
      raise(SIGSTOP);
      comm->all_reduce(&x, 1, ReduceOp::sum, "the step's norm")->wait();
    } else {
      // Only once it is stopped (ranks of these tests share one machine): on a loaded machine
      // it may leave the barrier late, and answer a probe still.
      const std::string stat = "/proc/" + std::to_string(int64_t(pids[size_t(last)])) + "/stat";
      bool stopped = false;
      for (int i = 0; i < 1000 && !stopped; ++i) {
        std::ifstream in(stat);
        std::string pid, name, state;
        in >> pid >> name >> state;  // the name has no spaces: the test binary's
        stopped = state == "T";
        if (!stopped) std::this_thread::sleep_for(std::chrono::milliseconds(10));
      }
      ASSERT_TRUE(stopped) << "rank " << last << " did not stop";
      try {
        comm->all_reduce(&x, 1, ReduceOp::sum, "the step's norm")->wait();
        ADD_FAILURE() << "no timeout";
      } catch (const Error& e) {
        const std::string msg = e.what();
        EXPECT_EQ(e.code(), ErrorCode::timeout) << msg;
        EXPECT_THAT(msg, HasSubstr("all_reduce of the step's norm"));
        EXPECT_THAT(msg, HasSubstr("no answer from rank " + std::to_string(last) + " (host "));
        for (int q = 0; q < last; ++q)  // the ranks that answer are not named
          EXPECT_THAT(msg, ::testing::Not(HasSubstr("rank " + std::to_string(q) + " (host")));
      }
      others->barrier("every running rank has its error");
      if (rank == 0) kill(pid_t(pids[size_t(last)]), SIGCONT);
    }
    world()->barrier("after the stopped rank");
  }
}

namespace {

// A one-rank world whose reduce-scatters never complete, as with a dead peer: their Work fails
// with a timeout and never settles. It records how long the engine is willing to wait.
class DeadPeerComm final : public Communicator {
 public:
  struct StuckWork final : Work {
    explicit StuckWork(std::vector<double>* waits) : waits_(waits) {}
    void wait() override {
      throw Error(ErrorCode::timeout, "reduce_scatter timed out (dead peer)");
    }
    bool done() override { return true; }
    bool wait_settled(double max_seconds) override {  // never settles: uses all it is given
      waits_->push_back(max_seconds);
      std::this_thread::sleep_for(std::chrono::duration<double>(max_seconds));
      return false;
    }
    double started_at() override { return 0; }
    double finished_at() override { return 0; }
    std::vector<double>* waits_;
  };
  int rank() const override { return 0; }
  int size() const override { return 1; }
  std::shared_ptr<Work> reduce_scatter(const void*, void*, int64_t, DType, std::string) override {
    return std::make_shared<StuckWork>(&waits);
  }
  std::shared_ptr<Work> all_gather(const void* s, void* r, int64_t n, DType d,
                                   std::string w) override {
    return self_->all_gather(s, r, n, d, std::move(w));
  }
  std::shared_ptr<Work> all_reduce(double* x, int64_t n, ReduceOp op, std::string w) override {
    return self_->all_reduce(x, n, op, std::move(w));
  }
  std::shared_ptr<Work> all_to_all(const void* s, const Pieces& sp, void* r, const Pieces& rp,
                                   DType d, std::string w) override {
    return self_->all_to_all(s, sp, r, rp, d, std::move(w));
  }
  std::shared_ptr<Work> all_reduce_sum(void* x, int64_t n, DType d, std::string w) override {
    return self_->all_reduce_sum(x, n, d, std::move(w));
  }
  std::shared_ptr<Work> broadcast(void* x, int64_t n, int root, std::string w) override {
    return self_->broadcast(x, n, root, std::move(w));
  }
  void barrier(std::string w) override { self_->barrier(std::move(w)); }
  std::shared_ptr<Communicator> split(const std::vector<int>& r, std::string w) override {
    return self_->split(r, std::move(w));
  }
  void set_timeout(double) override {}
  std::vector<double> waits;

 private:
  std::shared_ptr<Communicator> self_ = make_self_communicator();
};

}  // namespace

// After a collective failed because a peer died, destroying the engine waits for the abandoned
// collectives once, within one timeout in all, not one timeout per collective in flight.
TEST(Timeout, DestroyingTheEngineWaitsOneTimeoutInAll) {
  auto comm = std::make_shared<DeadPeerComm>();
  Config cfg;
  cfg.stage = 2;
  cfg.grad_buffers = 4;
  cfg.collective_timeout_s = 0.2;
  {
    Engine e(cfg, comm);
    for (const char* name : {"a", "b", "c", "d"}) e.add_unit(name, {Param{"w", {64}}});
    e.finalize();
    for (int u = 3; u >= 0; --u) {
      e.grads(u);
      e.grads_ready(u);
    }
    EXPECT_ZS_ERROR(e.step(), timeout, "dead peer");
  }
  // Every abandoned reduction is waited for, and the waits share one deadline: the first uses
  // it up (the fake sleeps all it is given), the others get what is left, nothing.
  ASSERT_EQ(comm->waits.size(), 4u);
  double total = 0;
  for (double w : comm->waits) total += w;
  EXPECT_LE(total, cfg.collective_timeout_s + 1e-6);
  EXPECT_GT(comm->waits.front(), 0.0);
}

TEST(Misuse, ClearErrors) {
  Config cfg;
  cfg.stage = 3;
  Engine e(cfg, world());
  EXPECT_ZS_ERROR(e.params(0), invalid_argument, "before finalize()");
  // A checkpoint of an engine with no state yet (this crashed once).
  EXPECT_ZS_ERROR(e.save("/tmp/zs-never-written"), invalid_argument,
                  "save(/tmp/zs-never-written) before finalize()");
  EXPECT_ZS_ERROR(e.save_async("/tmp/zs-never-written"), invalid_argument, "before finalize()");
  EXPECT_FALSE(std::filesystem::exists("/tmp/zs-never-written"));
  e.zero_grad();  // nothing to forget yet: a no-op, not a crash
  e.add_unit("u", {Param{"w", {5, 3}}, Param{"b", {3}}});
  EXPECT_ZS_ERROR(e.add_unit("u", {Param{"x", {1}}}), invalid_argument,
                  "a unit of that name exists");
  EXPECT_ZS_ERROR(e.add_unit("v", {Param{"x", {1}, 7}}), invalid_argument, "names group 7");
  e.finalize();
  EXPECT_ZS_ERROR(e.params(0), invalid_argument, "unit 'u' is not gathered");
  EXPECT_ZS_ERROR(e.release(0), invalid_argument, "is not gathered");
  EXPECT_ZS_ERROR(e.params(9), invalid_argument, "no unit with id 9");
  e.gather(0);
  EXPECT_ZS_ERROR(e.gather(0), invalid_argument, "already gathered");
  e.release(0);
  EXPECT_ZS_ERROR(e.grads_ready(0), invalid_argument, "call grads() first");
  EXPECT_ZS_ERROR(e.step(), invalid_argument, "0 of 1 micro-steps");

  // Gradients handed in by the trainer: wrong count, size, dtype.
  std::vector<float> w(15), b(3), wrong(4);
  std::vector<uint16_t> half(15);
  EXPECT_ZS_ERROR(e.grads_ready(0, {{w.data(), 15, DType::f32}}), invalid_argument,
                  "has 2 parameters, got 1");
  EXPECT_ZS_ERROR(e.grads_ready(0, {{w.data(), 15, DType::f32}, {wrong.data(), 4, DType::f32}}),
                  invalid_argument, "gradient of 'b' has 4 elements of f32, expected 3 of f32");
  EXPECT_ZS_ERROR(e.grads_ready(0, {{half.data(), 15, DType::bf16}, {b.data(), 3, DType::f32}}),
                  invalid_argument, "gradient of 'w' has 15 elements of bf16, expected 15 of f32");
  // The right ones go through, and a second micro-step beyond the configured one is refused.
  for (auto& x : w) x = 1.0f;
  e.grads_ready(0, {{w.data(), 15, DType::f32}, {b.data(), 3, DType::f32}});
  EXPECT_ZS_ERROR(e.grads(0), invalid_argument, "call step() first");
  StepResult r = e.step();
  EXPECT_FALSE(r.skipped);
  EXPECT_NEAR(r.grad_norm, std::sqrt(15.0), 1e-6);
  EXPECT_ZS_ERROR(e.set_lr(3, 0.1f), invalid_argument, "no parameter group 3");
}

// The nvme tier checks its configuration at construction and its paths at finalize(), where a
// path that one rank cannot use fails every rank (no rank is left waiting in a collective).
TEST(Misuse, NvmeTierChecksStageAndPaths) {
  Config cfg;
  cfg.stage = 0;
  cfg.offload_optimizer.tier = Tier::nvme;
  cfg.offload_optimizer.nvme_paths = {"/tmp"};
  EXPECT_ZS_ERROR(Engine(cfg, world()), invalid_config, "requires zero_optimization.stage >= 1");
  cfg.stage = 2;
  cfg.offload_optimizer.buffer_count = 1;
  EXPECT_ZS_ERROR(Engine(cfg, world()), invalid_config, "buffer_count = 1 must be >= 2");
  cfg.offload_optimizer.buffer_count = 4;
  cfg.offload_optimizer.nvme_paths = {"/tmp", "/tmp"};
  EXPECT_ZS_ERROR(Engine(cfg, world()), invalid_config,
                  "nvme_path[1] = \"/tmp\" repeats nvme_path[0]");
  cfg.offload_optimizer.nvme_paths = {"/tmp"};
  const std::string missing = "/nonexistent/zeroshard-swap";
  if (world()->rank() == world()->size() - 1) cfg.offload_optimizer.nvme_paths = {missing};
  Engine e(cfg, world());
  e.add_unit("u", {Param{"w", {5, 3}}});
  EXPECT_ZS_ERROR(e.finalize(), io_error,
                  "nvme path '" + missing + "' cannot be used: No such file or directory");
  e.zero_grad();  // the failed finalize() left no tiers: still a no-op, not a crash
  EXPECT_ZS_ERROR(e.step(), invalid_argument, "step() before finalize()");
  EXPECT_ZS_ERROR(e.save("/tmp/zs-never-written"), invalid_argument, "before finalize()");
}

}  // namespace

namespace zeroshard {
namespace {

// Inputs no update could have produced are refused where they come in, instead of training on
// as inf or NaN: an infinite learning rate, state that is not finite, a negative second moment,
// non-zero padding, and initial values announced without data.
TEST(InputChecks, RefusedWhereTheyComeIn) {
  Config c;
  c.stage = 2;
  c.optimizer.kind = OptimizerKind::adamw;
  Engine e(c, zs_test::world());
  Param bad{"w", {5}};
  bad.init.numel = 5;  // but no data
  EXPECT_ZS_ERROR(e.add_unit("u", {bad}), invalid_argument, "but no data");
  const UnitId u = e.add_unit("u", {Param{"w", {5}}});
  e.finalize();
  EXPECT_ZS_ERROR(e.set_lr(0, std::numeric_limits<float>::infinity()), invalid_argument,
                  "must be finite");
  const ShardInfo si = e.shard_info(u);
  std::vector<float> v(size_t(si.shard_numel), 0.0f);
  const int64_t real = std::max<int64_t>(0, std::min(si.numel - si.shard_offset, si.shard_numel));
  if (real > 0) {
    std::vector<float> nan = v;
    nan[0] = std::nanf("");
    EXPECT_ZS_ERROR(e.write_shard(u, StateKind::master, nan), invalid_argument, "must be finite");
    std::vector<float> neg = v;
    neg[0] = -1.0f;
    EXPECT_ZS_ERROR(e.write_shard(u, StateKind::state1, neg), invalid_argument, "is negative");
    EXPECT_NO_THROW(e.write_shard(u, StateKind::state0, neg));  // a first moment may be
  }
  if (real < si.shard_numel) {
    std::vector<float> pad = v;
    pad[size_t(si.shard_numel - 1)] = 1.0f;
    EXPECT_ZS_ERROR(e.write_shard(u, StateKind::master, pad), invalid_argument, "padding");
  }
  e.commit_shards();
}

}  // namespace
}  // namespace zeroshard
