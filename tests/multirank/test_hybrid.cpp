// Hierarchical sharding (Config::shard_group_size): shards within groups of consecutive ranks,
// replicated across the groups. What must hold, at every world size that has such groups:
// - the groups' replicas stay bitwise equal, and stages 1–3 bitwise equal one another (each
//   reduces the same shards the same way: reduce-scatter in the group, all-reduce across);
// - against flat sharding the sums come in another order (within the group, then across), so
//   the results are bitwise equal where every partial sum is exact: gradients on a grid of
//   1/8 in [-2, 2] (exact in bf16 and f32 however they are added, squares too);
// - each rank holds what a flat rank of a world of the group's size holds (plan == ledger);
// - a checkpoint is the first group's shards, as a flat run of the group's size writes them,
//   and loads into flat and hierarchical engines alike.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstring>
#include <filesystem>

#include "base/layout.hpp"
#include "src/muon_exchange.hpp"
#include "tests/multirank/harness.hpp"

using namespace zeroshard;
using zs_test::shared_dir;
using zs_test::world;
namespace fs = std::filesystem;

namespace {

// Group sizes below the world size that divide it (none at one rank).
std::vector<int> group_sizes() {
  std::vector<int> s;
  for (int n = 1; n < world()->size(); ++n)
    if (world()->size() % n == 0) s.push_back(n);
  return s;
}

#define SKIP_WITHOUT_GROUPS()                                                             \
  if (group_sizes().empty()) GTEST_SKIP() << "one rank: no group smaller than the world"; \
  static_assert(true)

struct HybridRun {
  int stage = 1;
  DType dtype = DType::bf16;
  Tier tier = Tier::device;
  int group = 0;  // shard_group_size
  int micro = 1;
  bool exact = false;  // gradients on the grid of 1/8 in [-2, 2]
};

Config make_config(const HybridRun& r) {
  Config cfg;
  cfg.stage = r.stage;
  cfg.dtype = r.dtype;
  cfg.gradient_accumulation_steps = r.micro;
  cfg.gradient_clipping = 1.0;  // engages: the norm path is compared too
  cfg.loss_scale.initial_scale_power = 8;
  cfg.optimizer.kind = OptimizerKind::adamw;
  cfg.optimizer.lr = 1e-2f;
  cfg.optimizer.weight_decay = 0.05f;
  cfg.shard_alignment = 4;
  cfg.collective_timeout_s = 120;
  cfg.offload_optimizer.tier = r.tier;
  cfg.offload_optimizer.nvme_paths = {
      (fs::temp_directory_path() / "zeroshard-hybrid-swap").string()};
  fs::create_directories(cfg.offload_optimizer.nvme_paths[0]);
  cfg.shard_group_size = r.group;
  return cfg;
}

// Every unit's whole values of each state kind, from the first group's shards (gathered over
// the world, which holds them in rank order), and whether every group held the same.
struct Whole {
  std::vector<std::vector<float>> v[4];  // param, master, state0, state1
  bool replicas_equal = true;
};

Whole whole_state(Engine& e) {
  Whole w;
  const ShardGroup g = e.shard_group();
  const StateKind kinds[4] = {StateKind::param, StateKind::master, StateKind::state0,
                              StateKind::state1};
  for (int k = 0; k < 4; ++k)
    for (int u = 0; u < e.num_units(); ++u) {
      const ShardInfo si = e.shard_info(u);
      std::vector<float> mine = e.read_shard(u, kinds[k]);
      std::vector<float> all(mine.size() * size_t(world()->size()));
      world()
          ->all_gather(mine.data(), all.data(), int64_t(mine.size()), DType::f32, "test")
          ->wait();
      const size_t group_bytes = size_t(si.padded_numel) * 4;
      for (int r = 1; r < g.count; ++r)
        w.replicas_equal &=
            std::memcmp(all.data(), all.data() + size_t(r) * size_t(si.padded_numel),
                        group_bytes) == 0;
      all.resize(size_t(si.numel));
      w.v[k].push_back(std::move(all));
    }
  return w;
}

Whole train_and_read(const HybridRun& r, std::vector<StepResult>* results = nullptr) {
  Engine e(make_config(r), world());
  zs_test::register_model(e, zs_test::uneven_model());
  zs_test::TrainOptions opt;
  opt.micro_batches = r.micro;
  if (r.exact)
    opt.tamper = [](Engine& en, int, int, int64_t, std::vector<TensorView>& g) {
      const float scale = en.loss_scale();
      for (TensorView& t : g)
        for (int64_t i = 0; i < t.numel; ++i) {
          const float v = zs_test::load(t.data, t.dtype, i) / scale;
          const float q = std::fmin(2.0f, std::fmax(-2.0f, std::nearbyint(v * 8.0f) / 8.0f));
          zs_test::store(t.data, t.dtype, i, q * scale);
        }
    };
  std::vector<StepResult> res = zs_test::train(e, opt);
  int taken = 0;
  for (const StepResult& s : res) taken += !s.skipped;
  EXPECT_GE(taken, 15) << "most steps must update for the comparison to mean something";
  if (results) *results = res;
  return whole_state(e);
}

bool same(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), a.size() * 4) == 0);
}

void expect_same(const Whole& a, const Whole& b, const std::string& what) {
  const char* names[4] = {"param", "master", "state0", "state1"};
  for (int k = 0; k < 4; ++k)
    for (size_t u = 0; u < a.v[k].size(); ++u)
      EXPECT_TRUE(same(a.v[k][u], b.v[k][u])) << what << ": unit " << u << " " << names[k];
}

std::string label(const HybridRun& r) {
  return "stage " + std::to_string(r.stage) + ", " + dtype_name(r.dtype) + ", " +
         tier_name(r.tier) + ", groups of " + std::to_string(r.group) + ", k " +
         std::to_string(r.micro);
}

}  // namespace

// Exact sums: hierarchical sharding trains bitwise as flat sharding does.
TEST(Hybrid, MatchesFlatShardingBitwiseWhereSumsAreExact) {
  SKIP_WITHOUT_GROUPS();
  for (DType dt : {DType::bf16, DType::f32})
    for (int micro : {1, 2}) {
      HybridRun flat{.stage = 1, .dtype = dt, .micro = micro, .exact = true};
      const Whole ref = train_and_read(flat);
      double moved = 0;
      for (const auto& s : ref.v[2])
        for (float x : s) moved += std::fabs(x);
      EXPECT_GT(moved, 0.0) << "optimizer state stayed zero";
      for (int group : group_sizes())
        for (int stage = 1; stage <= 3; ++stage)
          for (Tier tier : {Tier::device, Tier::host}) {
            HybridRun r{stage, dt, tier, group, micro, true};
            SCOPED_TRACE(label(r));
            const Whole h = train_and_read(r);
            EXPECT_TRUE(h.replicas_equal);
            expect_same(ref, h, "against flat sharding");
          }
    }
}

// Any gradients: the replicas stay bitwise equal, and every stage and tier trains alike.
TEST(Hybrid, ReplicasStayEqualAndStagesAgreeBitwise) {
  SKIP_WITHOUT_GROUPS();
  for (int group : group_sizes()) {
    HybridRun base{.stage = 1, .group = group, .micro = 2};
    std::vector<StepResult> ref_steps;
    const Whole ref = train_and_read(base, &ref_steps);
    EXPECT_TRUE(ref.replicas_equal);
    for (int stage = 1; stage <= 3; ++stage)
      for (Tier tier : {Tier::device, Tier::host, Tier::nvme}) {
        HybridRun r{stage, DType::bf16, tier, group, 2, false};
        if (r.stage == 1 && tier == Tier::device) continue;  // the reference
        SCOPED_TRACE(label(r));
        std::vector<StepResult> steps;
        const Whole h = train_and_read(r, &steps);
        EXPECT_TRUE(h.replicas_equal);
        expect_same(ref, h, "against stage 1 on the device tier");
        ASSERT_EQ(steps.size(), ref_steps.size());
        for (size_t i = 0; i < steps.size(); ++i)
          EXPECT_EQ(steps[i].grad_norm, ref_steps[i].grad_norm) << "step " << i;
      }
  }
}

// A rank holds what a rank of a flat world of the group's size holds, buffer by buffer, and the
// planner says so as well.
TEST(Hybrid, HoldsTheShardOfAWorldOfTheGroupsSize) {
  SKIP_WITHOUT_GROUPS();
  std::vector<PlanUnit> units;
  for (const auto& u : zs_test::uneven_model()) {
    PlanUnit pu{u.name, {}};
    for (const auto& [name, shape] : u.params) pu.params.push_back(Param{name, shape});
    units.push_back(pu);
  }
  for (int group : group_sizes())
    for (int stage = 1; stage <= 3; ++stage)
      for (Tier tier : {Tier::device, Tier::host}) {
        HybridRun r{stage, DType::bf16, tier, group};
        SCOPED_TRACE(label(r));
        const Config cfg = make_config(r);
        Engine e(cfg, world());
        zs_test::register_model(e, zs_test::uneven_model());
        const ShardGroup g = e.shard_group();
        EXPECT_EQ(g.size, group);
        EXPECT_EQ(g.count, world()->size() / group);
        EXPECT_EQ(g.rank, world()->rank() % group);
        EXPECT_EQ(g.index, world()->rank() / group);
        Config flat = cfg;
        flat.shard_group_size = 0;
        const MemoryReport real = e.memory();
        const MemoryReport plan = plan_memory(cfg, units, world()->size(), world()->rank());
        const MemoryReport as_flat = plan_memory(flat, units, group, g.rank);
        for (int t = 0; t < kNumTiers; ++t)
          for (int k = 0; k < kNumMemKinds; ++k) {
            EXPECT_EQ(plan.bytes[t][k], real.bytes[t][k]) << "tier " << t << " kind " << k;
            EXPECT_EQ(as_flat.bytes[t][k], real.bytes[t][k]) << "tier " << t << " kind " << k;
          }
        EXPECT_GT(real.at(tier, MemKind::optim_state), 0);
      }
}

// The checkpoint of a hierarchical run is that of a flat run of the group's size: it resumes
// bitwise into a hierarchical engine, and loads into a flat one with the same values (and a
// flat checkpoint into a hierarchical engine).
TEST(Hybrid, CheckpointsLoadIntoFlatAndHierarchicalEngines) {
  SKIP_WITHOUT_GROUPS();
  const fs::path root = shared_dir("hybrid-ckpt");
  const int group = group_sizes().back();
  for (Tier tier : {Tier::host, Tier::nvme}) {
    HybridRun r{3, DType::bf16, tier, group, 1, false};
    SCOPED_TRACE(label(r));
    zs_test::TrainOptions opt;
    opt.steps = 6;
    Engine a(make_config(r), world());
    zs_test::register_model(a, zs_test::uneven_model());
    zs_test::train(a, opt);
    const fs::path saved = a.save(root, std::string("h") + tier_name(tier));
    zs_test::train(a, opt);  // the run goes on ...
    const Whole a_end = whole_state(a);

    Engine b(make_config(r), world());  // ... and resumes from the checkpoint bitwise
    zs_test::register_model(b, zs_test::uneven_model());
    b.load(saved);
    const Whole b_start = whole_state(b);
    zs_test::train(b, opt);
    expect_same(a_end, whole_state(b), "resumed");

    HybridRun f = r;
    f.group = 0;
    Engine c(make_config(f), world());  // a flat engine holds the same values
    zs_test::register_model(c, zs_test::uneven_model());
    c.load(saved);
    expect_same(b_start, whole_state(c), "loaded into flat sharding");
    EXPECT_EQ(c.step_count(), b.step_count() - opt.steps);

    const fs::path flat_saved = c.save(root, std::string("f") + tier_name(tier));
    Engine d(make_config(r), world());  // and back
    zs_test::register_model(d, zs_test::uneven_model());
    d.load(flat_saved);
    expect_same(b_start, whole_state(d), "flat checkpoint into hierarchical sharding");
  }
  world()->barrier("test");
  if (world()->rank() == 0) fs::remove_all(root);
}

namespace {

// One micro-step's gradients of unit `u` from its parameters, scaled as the engine expects.
void write_grads(Engine& e, int u, int micro, const std::vector<TensorView>& p,
                 const std::vector<TensorView>& g) {
  int64_t flat = 0;
  for (size_t t = 0; t < p.size(); ++t)
    for (int64_t i = 0; i < p[t].numel; ++i, ++flat) {
      const float v = zs_test::synthetic_grad(zs_test::load(p[t].data, p[t].dtype, i), u, flat,
                                              e.rank(), micro, 0);
      zs_test::store(g[t].data, g[t].dtype, i, v * e.loss_scale());
    }
}

// One step of two micro-steps over embed (0) and head (1), stage 3 without prefetch. Between
// the micro-steps, with `diverge`, ranks 0 and 3 gather embed before they take head's next
// gradient buffer (which lands head's reduction, across the groups too), ranks 1 and 2 after.
Whole step_in_two_orders(bool diverge) {
  HybridRun r{3, DType::f32, Tier::device, 2, 2, false};
  Config cfg = make_config(r);
  cfg.prefetch = false;  // a gather starts when the trainer asks for it
  cfg.collective_timeout_s = 30;
  Engine e(cfg, world());
  zs_test::register_model(e, {{"embed", {{"w", {16, 8}}}}, {"head", {{"w", {8, 16}}}}});
  std::vector<TensorView> p = e.gather(1), g = e.grads(1);
  write_grads(e, 1, 0, p, g);
  e.grads_ready(1);
  e.release(1);
  std::vector<TensorView> head_next;
  const int rank = world()->rank();
  if (!diverge || rank == 0 || rank == 3) {
    p = e.gather(0);
    head_next = e.grads(1);
  } else {
    head_next = e.grads(1);
    p = e.gather(0);
  }
  g = e.grads(0);
  write_grads(e, 0, 0, p, g);
  e.grads_ready(0);
  e.release(0);
  p = e.gather(1);
  write_grads(e, 1, 1, p, head_next);
  e.grads_ready(1);
  e.release(1);
  p = e.gather(0);
  g = e.grads(0);
  write_grads(e, 0, 1, p, g);
  e.grads_ready(0);
  e.release(0);
  EXPECT_FALSE(e.step().skipped);
  return whole_state(e);
}

}  // namespace

// A rank blocked on a collective of its group still starts the all-reduces across the groups of
// its reductions that landed meanwhile: its replica in the other group waits for them. Here
// rank 0 waits in embed's gather for rank 1, which waits in head's all-reduce across for rank
// 3, which waits in the gather for rank 2, which waits across for rank 0: round the four ranks,
// unless a rank that waits keeps crossing. The step then equals the one in a single order.
TEST(Hybrid, CrossesTheGroupsWhileWaitingOnTheGroup) {
  if (world()->size() != 4) GTEST_SKIP() << "the cycle takes two groups of two ranks";
  const Whole diverged = step_in_two_orders(true);
  expect_same(step_in_two_orders(false), diverged, "ranks that wait in different orders");
  EXPECT_TRUE(diverged.replicas_equal);
}

// Bad groups are refused on every rank, naming the setting.
TEST(Hybrid, RefusesGroupsThatCannotShard) {
  const int w = world()->size();
  HybridRun r{.stage = 2, .group = w + 1};
  EXPECT_ZS_ERROR(Engine(make_config(r), world()), invalid_config,
                  "shard_group_size = " + std::to_string(w + 1) + " does not divide");
  if (w == 1) return;
  HybridRun s0{.stage = 0, .group = 1};
  EXPECT_ZS_ERROR(Engine(make_config(s0), world()), invalid_config, "stage 0 shards nothing");
  // Ranks that disagree on the group size find out before splitting (a rank with flat
  // sharding would join no check: its peers' would time out instead).
  if (w == 4) {
    HybridRun mixed{.stage = 2, .group = world()->rank() == 0 ? 1 : 2};
    EXPECT_ZS_ERROR(Engine(make_config(mixed), world()), invalid_config,
                    "shard_group_size differs between ranks");
  }
}

namespace {

// This rank's host name, and whether world rank `r` runs on the same host.
bool same_host(int r) {
  char name[64] = {};
  ::gethostname(name, sizeof name - 1);
  std::vector<char> all(64 * size_t(world()->size()));
  for (int q = 0; q < world()->size(); ++q) {
    char buf[64];
    std::memcpy(buf, name, 64);
    world()->broadcast(buf, 64, q, "test")->wait();
    std::memcpy(all.data() + 64 * size_t(q), buf, 64);
  }
  return std::memcmp(all.data() + 64 * size_t(r), name, 64) == 0;
}

}  // namespace

// StepResult counts what the collectives of a step send, as a ring over each communicator, and
// the part that goes to another host: per unit and step, a reduce-scatter and (stages 1-2) an
// all-gather of the new parameters or (stage 3) the gather, each (n - 1) shards within the
// group, and an all-reduce across the groups, 2 (g - 1) / g shards. On one host nothing
// crosses; across hosts (tests/multinode) the group's ring stays on its host.
TEST(Hybrid, CountsTheBytesThatCrossHosts) {
  const int w = world()->size();
  std::vector<int> groups = group_sizes();
  groups.push_back(w);
  for (int group : groups)
    for (int stage = 1; stage <= 3; ++stage) {
      HybridRun run{stage, DType::bf16, Tier::device, group};
      SCOPED_TRACE(label(run));
      Config cfg = make_config(run);
      cfg.prefetch = false;  // a dropped prefetch would gather once more
      Engine e(cfg, world());
      zs_test::register_model(e, zs_test::uneven_model());
      const ShardGroup g = e.shard_group();
      const bool group_remote = !same_host(g.index * g.size + (g.rank + 1) % g.size);
      const bool across_remote = !same_host((g.index + 1) % g.count * g.size + g.rank);
      int64_t within = 0, across = 0;
      for (int u = 0; u < e.num_units(); ++u) {
        const int64_t shard = e.shard_info(u).shard_numel * 2;  // bf16 bytes
        within += 2 * int64_t(g.size - 1) * shard;              // reduce-scatter, then gather
        across += 2 * int64_t(g.count - 1) * shard / g.count;
      }
      zs_test::TrainOptions opt;
      opt.steps = 3;
      for (const StepResult& s : zs_test::train(e, opt)) {
        EXPECT_EQ(s.comm_bytes, within + across);
        EXPECT_EQ(s.inter_node_bytes, (group_remote ? within : 0) + (across_remote ? across : 0));
      }
      if (group < w) {
        EXPECT_GT(across, 0);
      }
    }
}

// Muon's exchange sends its pieces point to point (src/muon_exchange.hpp), each to the rank
// that orthogonalises its matrix or back: StepResult counts each piece by the host it goes to,
// not by the ring's next rank. A Muon engine sends what an AdamW engine on the same model sends,
// plus this rank's pieces to the others (computed here from the layout, the owners and the
// rounds); across hosts (tests/multinode) some of them cross.
TEST(Hybrid, CountsMuonsPiecesByTheHostTheyGoTo) {
  const int w = world()->size();
  const std::vector<zs_test::UnitSpec> model = {
      {"a", {{"w", {12, 10}}, {"w2", {7, 9}}}},
      {"m", {{"w", {20, 6}}, {"b", {6}}}},
      {"c", {{"w", {5, 31}}, {"w2", {3, 3}}, {"w3", {9, 2}}}}};
  std::vector<int> groups = group_sizes();
  groups.push_back(w);
  OptimizerOptions adamw;
  adamw.kind = OptimizerKind::adamw;
  adamw.lr = 1e-2f;
  std::vector<bool> here;  // per world rank: on this rank's host (same_host() is collective)
  for (int r = 0; r < w; ++r) here.push_back(same_host(r));
  for (int group : groups)
    for (int stage = 0; stage <= 3; ++stage) {
      if (stage == 0 && group < w) continue;  // stage 0 shards nothing
      HybridRun run{stage, DType::f32, Tier::device, group};
      SCOPED_TRACE(label(run));
      Config cfg = make_config(run);
      cfg.prefetch = false;
      Config muon = cfg;
      muon.optimizer.kind = OptimizerKind::muon;
      muon.optimizer.momentum = 0.9f;
      Engine plain(cfg, world()), e(muon, world());
      for (Engine* x : {&plain, &e}) {
        x->add_group(adamw);
        zs_test::register_model(*x, model, 1);
      }
      // This rank's pieces, as the engine plans them.
      const ShardGroup g = e.shard_group();
      std::vector<double> load(size_t(g.size), 0.0);
      int64_t sent = 0, inter = 0;
      for (size_t u = 0; u < model.size(); ++u) {
        std::vector<Param> params;
        for (const auto& [name, shape] : model[u].params)
          params.push_back(Param{name, shape, name[0] == 'b' ? 1 : 0});
        const UnitLayout L = plan_unit(model[u].name, params, g.size, cfg.shard_alignment);
        ASSERT_EQ(L.padded_numel, e.shard_info(int(u)).padded_numel);
        const std::vector<MuonMatrix> mats = muon_matrices(L, {muon.optimizer, adamw}, load);
        for (const MuonRound& round : muon_rounds(mats, g.size, stage == 0 ? 0 : L.shard_numel))
          for (const auto* ts : {&round.gather, &round.scatter})
            for (const MuonTransfer& t : *ts)
              if (t.from == g.rank && t.to != g.rank) {
                sent += t.count * 4;
                inter += here[size_t(g.index * g.size + t.to)] ? 0 : t.count * 4;
              }
      }
      if (g.size > 1) {
        EXPECT_GT(sent, 0);
      }
      zs_test::TrainOptions opt;
      opt.steps = 2;
      const std::vector<StepResult> a = zs_test::train(plain, opt), b = zs_test::train(e, opt);
      for (size_t i = 0; i < a.size(); ++i) {
        EXPECT_EQ(b[i].comm_bytes - a[i].comm_bytes, sent);
        EXPECT_EQ(b[i].inter_node_bytes - a[i].inter_node_bytes, inter);
      }
    }
}
