// Muon (src/engine_muon.cpp): matrices in a Muon group, vectors in an AdamW group, as the usual
// hybrid does.
// - Against a plain single-process reference written here in double (torch.optim.Muon's
//   algorithm: averaged momentum, Nesterov, the quintic Newton-Schulz iteration, the shape's
//   learning-rate factor, decoupled decay; AdamW for the vectors), at stage 0 and stage 3.
// - Stages 1–3 on the device (CPU), host and nvme tiers, f32 and bf16 models, with and without
//   accumulation and 8-bit moments, bitwise equal to stage 0 on the same ranks: each matrix is
//   orthogonalised by one rank from the same whole direction whatever the stage, so any
//   difference is a bug in the exchange.
// - A Muon parameter of one dimension is refused at finalize(), naming it.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>

#include "src/compute/compute.hpp"
#include "tests/multirank/harness.hpp"
#include "zeroshard/planner.hpp"

using namespace zeroshard;
using zs_test::shared_dir;
using zs_test::world;
namespace fs = std::filesystem;

namespace {

// Matrices cut by shards at odd offsets: tall, wide and square ones, and one of 3 dimensions
// (a (4, 3, 5) weight is a 4 × 15 matrix); vectors ('b…') in group 1.
std::vector<zs_test::UnitSpec> muon_model() {
  return {
      {"embed", {{"w", {37, 11}}}},
      {"layer0", {{"w", {11, 23}}, {"b", {23}}, {"w2", {9, 9}}}},
      {"conv", {{"w", {4, 3, 5}}, {"b", {4}}}},
      {"tiny", {{"b", {1}}}},
      {"head", {{"w", {13, 41}}, {"b", {41}}}},
  };
}

struct Case {
  int stage;
  Tier tier = Tier::device;
  DType dtype = DType::f32;
  int micro = 1;
  StateFormat state = StateFormat::f32;
  int group = 0;  // Config::shard_group_size (hierarchical sharding)
};

OptimizerOptions muon_options() {
  OptimizerOptions o;
  o.kind = OptimizerKind::muon;
  o.lr = 2e-2f;
  o.momentum = 0.95f;
  o.nesterov = true;
  o.weight_decay = 0.1f;
  o.eps = 1e-7f;
  return o;
}

OptimizerOptions adamw_options() {
  OptimizerOptions o;
  o.kind = OptimizerKind::adamw;
  o.lr = 1e-2f;
  o.weight_decay = 0.0f;
  return o;
}

Config make_config(const Case& c) {
  Config cfg;
  cfg.stage = c.stage;
  cfg.dtype = c.dtype;
  cfg.gradient_accumulation_steps = c.micro;
  cfg.optimizer = muon_options();
  cfg.shard_alignment = 4;  // shards cut through matrices
  cfg.collective_timeout_s = 120;
  cfg.optimizer_state = c.state;
  cfg.state_block = 64;
  cfg.offload_optimizer.tier = c.tier;
  cfg.shard_group_size = c.group;
  if (c.tier == Tier::nvme) {
    const fs::path root = fs::temp_directory_path() / "zeroshard-muon-tests";
    fs::create_directories(root);
    cfg.offload_optimizer.nvme_paths = {root.string()};
    cfg.aio.block_size = 4096;
  }
  return cfg;
}

struct Snapshot {
  std::vector<std::vector<float>> param, master, s0;
};

Snapshot run(const Case& c, int steps = 12) {
  Engine e(make_config(c), world());
  EXPECT_EQ(e.add_group(adamw_options()), 1);
  zs_test::register_model(e, muon_model(), 1);
  zs_test::TrainOptions opt;
  opt.steps = steps;
  opt.micro_batches = c.micro;
  int taken = 0;
  for (auto& r : zs_test::train(e, opt)) taken += !r.skipped;
  EXPECT_GE(taken, steps - 3);
  // The exchange's buffer is in the ledger, where the state is: in device memory where the
  // device has streams (the asynchronous device playing a GPU), else on the host.
  const MemoryReport mem = e.memory();
  const auto dir = std::find_if(mem.buffers.begin(), mem.buffers.end(),
                                [](const NamedBuffer& b) { return b.name == "muon_direction"; });
  EXPECT_NE(dir, mem.buffers.end());
  if (dir != mem.buffers.end()) {
    EXPECT_GT(dir->bytes, 0);
    const bool on_device = c.tier == Tier::device && async_device_selected(e.config());
    EXPECT_EQ(dir->tier, on_device ? Tier::device : Tier::host);
  }
  Snapshot s;
  for (int u = 0; u < e.num_units(); ++u) {
    s.param.push_back(e.read_shard(u, StateKind::param));
    s.master.push_back(e.read_shard(u, StateKind::master));
    s.s0.push_back(e.read_shard(u, StateKind::state0));
  }
  return s;
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), a.size() * 4) == 0);
}

// ---- the reference, in double ----------------------------------------------------------------

using Mat = std::vector<double>;  // row-major

Mat matmul(const Mat& a, const Mat& b, int64_t m, int64_t k, int64_t n, bool bt) {
  Mat c(size_t(m * n), 0.0);
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < n; ++j) {
      double s = 0;
      for (int64_t p = 0; p < k; ++p)
        s += a[size_t(i * k + p)] * (bt ? b[size_t(j * k + p)] : b[size_t(p * n + j)]);
      c[size_t(i * n + j)] = s;
    }
  return c;
}

// torch.optim.Muon's zeropower_via_newtonschulz, in double.
Mat orthogonalise(const Mat& g, int64_t rows, int64_t cols, int steps, double eps) {
  const bool tall = rows > cols;
  const int64_t m = tall ? cols : rows, n = tall ? rows : cols;
  Mat x(size_t(m * n));
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = 0; j < cols; ++j)
      x[size_t(tall ? j * n + i : i * n + j)] = g[size_t(i * cols + j)];
  double ss = 0;
  for (double v : x) ss += v * v;
  const double norm = std::max(std::sqrt(ss), eps);
  for (double& v : x) v /= norm;
  const double a = 3.4445, b = -4.7750, c = 2.0315;
  for (int s = 0; s < steps; ++s) {
    Mat A = matmul(x, x, m, n, m, true);
    Mat AA = matmul(A, A, m, m, m, false);
    Mat B(A.size());
    for (size_t i = 0; i < A.size(); ++i) B[i] = b * A[i] + c * AA[i];
    Mat BX = matmul(B, x, m, m, n, false);
    for (size_t i = 0; i < x.size(); ++i) x[i] = a * x[i] + BX[i];
  }
  Mat out(size_t(rows * cols));
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = 0; j < cols; ++j)
      out[size_t(i * cols + j)] = x[size_t(tall ? j * n + i : i * n + j)];
  return out;
}

}  // namespace

class Muon : public ::testing::TestWithParam<std::pair<int, int>> {};

// Also with hierarchical sharding (shard_group_size 2: shards within pairs of ranks, the same
// exchange in each pair), where the world has pairs.
TEST_P(Muon, MatchesAFloat64Reference) {
  const auto [stage, group] = GetParam();
  if (group > 0 && (world()->size() % group != 0 || world()->size() == group))
    GTEST_SKIP() << "needs a world of several groups of " << group << " ranks";
  const int steps = 10;
  Case c{stage, stage == 3 ? Tier::host : Tier::device};
  c.group = group;
  Snapshot got = run(c, steps);
  const OptimizerOptions mo = muon_options(), ao = adamw_options();
  const auto model = muon_model();
  const int W = world()->size();
  Engine probe(make_config(c), world());  // where this rank's shard of each unit starts
  probe.add_group(ao);
  zs_test::register_model(probe, model, 1);
  double worst = 0, moved = 0;
  for (size_t u = 0; u < model.size(); ++u) {
    std::vector<double> p, m, v;
    struct Piece {
      int64_t offset, rows, cols;
      bool muon;
    };
    std::vector<Piece> pieces;
    for (const auto& [name, shape] : model[u].params) {
      auto init = zs_test::init_values(model[u].name, name, shape_numel(shape));
      pieces.push_back(
          {int64_t(p.size()), shape[0], shape_numel(shape) / shape[0], name[0] != 'b'});
      p.insert(p.end(), init.begin(), init.end());
    }
    const std::vector<double> p0 = p;
    m.assign(p.size(), 0);
    v.assign(p.size(), 0);
    for (int t = 1; t <= steps; ++t) {
      std::vector<double> g(p.size());
      for (size_t i = 0; i < p.size(); ++i) {
        for (int r = 0; r < W; ++r)
          g[i] += zs_test::synthetic_grad(float(p[i]), int(u), int64_t(i), r, 0, t - 1);
        g[i] /= W;
      }
      for (const Piece& pc : pieces) {
        const size_t b = size_t(pc.offset), n = size_t(pc.rows * pc.cols);
        if (pc.muon) {
          Mat d(n);
          for (size_t i = 0; i < n; ++i) {
            m[b + i] = mo.momentum * m[b + i] + (1 - double(mo.momentum)) * g[b + i];
            d[i] = (1 - double(mo.momentum)) * g[b + i] + mo.momentum * m[b + i];
          }
          const Mat o = orthogonalise(d, pc.rows, pc.cols, mo.ns_steps, mo.eps);
          const double f = std::sqrt(std::max(1.0, double(pc.rows) / double(pc.cols)));
          for (size_t i = 0; i < n; ++i) {
            p[b + i] -= double(mo.lr) * mo.weight_decay * p[b + i];
            p[b + i] -= double(mo.lr) * f * o[i];
          }
        } else {
          for (size_t i = b; i < b + n; ++i) {
            const double b1 = ao.beta1, b2 = ao.beta2;
            m[i] = b1 * m[i] + (1 - b1) * g[i];
            v[i] = b2 * v[i] + (1 - b2) * g[i] * g[i];
            const double mh = m[i] / (1 - std::pow(b1, t)), vh = v[i] / (1 - std::pow(b2, t));
            p[i] -= double(ao.lr) * mh / (std::sqrt(vh) + ao.eps);
          }
        }
      }
    }
    const ShardInfo si = probe.shard_info(int(u));
    const int64_t start = si.shard_offset;  // read_shard() gives this rank's shard at every stage
    for (size_t i = 0; i < got.master[u].size(); ++i) {
      const int64_t k = start + int64_t(i);
      if (k >= int64_t(p.size())) {
        EXPECT_EQ(got.master[u][i], 0.0f) << "padding of unit " << u;
        continue;
      }
      worst = std::max(worst, std::fabs(double(got.master[u][i]) - p[size_t(k)]));
      moved = std::max(moved, std::fabs(p[size_t(k)] - p0[size_t(k)]));
    }
  }
  std::printf(
      "[muon] stage %d, shard groups of %d: worst |engine - reference| = %.3g (largest "
      "move %.3g)\n",
      stage, group > 0 ? group : world()->size(), worst, moved);
  EXPECT_GT(moved, 0.05) << "the reference must move for the comparison to mean something";
  EXPECT_LT(worst, 2e-5);
}

INSTANTIATE_TEST_SUITE_P(Stages, Muon,
                         ::testing::Values(std::make_pair(0, 0), std::make_pair(3, 0),
                                           std::make_pair(2, 2), std::make_pair(3, 2)));

class MuonParity : public ::testing::TestWithParam<Case> {};

TEST_P(MuonParity, MatchesStageZeroBitwise) {
  const Case c = GetParam();
  Case ref_case = c;
  ref_case.stage = 0;
  ref_case.tier = Tier::device;
  const Snapshot ref = run(ref_case);
  const Snapshot s = run(c);
  for (size_t u = 0; u < ref.param.size(); ++u) {
    EXPECT_TRUE(same_bits(ref.master[u], s.master[u])) << "unit " << u << " master";
    EXPECT_TRUE(same_bits(ref.s0[u], s.s0[u])) << "unit " << u << " momentum";
    EXPECT_TRUE(same_bits(ref.param[u], s.param[u])) << "unit " << u << " parameters";
  }
}

std::string case_name(const ::testing::TestParamInfo<Case>& i) {
  const Case& c = i.param;
  return "stage" + std::to_string(c.stage) + "_" + tier_name(c.tier) + "_" + dtype_name(c.dtype) +
         "_k" + std::to_string(c.micro) + "_" + state_format_name(c.state);
}

INSTANTIATE_TEST_SUITE_P(Tiers, MuonParity,
                         ::testing::Values(Case{1}, Case{2}, Case{3}, Case{1, Tier::host},
                                           Case{2, Tier::host}, Case{3, Tier::host},
                                           Case{1, Tier::nvme}, Case{3, Tier::nvme},
                                           Case{2, Tier::device, DType::bf16},
                                           Case{3, Tier::host, DType::bf16, 2},
                                           Case{2, Tier::nvme, DType::bf16, 2},
                                           Case{3, Tier::device, DType::f32, 1, StateFormat::q8},
                                           Case{2, Tier::host, DType::bf16, 1, StateFormat::bf16}),
                         case_name);

// A matrix beyond MPI's int counts could fail on the ranks holding pieces of it only, the others
// waiting for them: refused at finalize(), on every rank (planned here: nothing is allocated).
TEST(MuonRefuses, APieceBeyondMpisCounts) {
  const std::vector<PlanUnit> units = {{"huge", {Param{"w", {65536, 32769}}}}};
  for (int stage : {0, 2}) {
    EXPECT_ZS_ERROR(plan_memory(make_config({stage}), units, 2, 0), invalid_argument,
                    "beyond the int counts of an MPI collective");
  }
  // One rank exchanges nothing.
  EXPECT_NO_THROW(plan_memory(make_config({2}), units, 1, 0));
}

TEST(MuonRefuses, AVectorInAMuonGroup) {
  Engine e(make_config({1}), world());
  e.add_unit("layer", {{"w", {4, 4}}, {"gain", {4}}});
  try {
    e.finalize();
    FAIL() << "finalize() took a vector in a Muon group";
  } catch (const Error& err) {
    EXPECT_NE(std::string(err.what()).find("'gain'"), std::string::npos) << err.what();
    EXPECT_NE(std::string(err.what()).find("adamw group"), std::string::npos) << err.what();
  }
}

// A checkpoint carries Muon's settings: an engine built with other ones (the defaults) that
// loads it at another stage and tier continues bitwise like the one that saved it. The saving
// engine runs the options the other tests leave alone: no Nesterov, AdamW-matched learning-rate
// scaling, 3 iterations in bf16.
TEST(MuonCheckpoint, ResumesBitwiseWithTheSavedSettings) {
  const fs::path dir = shared_dir("muon-checkpoint");
  Case saver{3, Tier::host};
  Config cfg = make_config(saver);
  cfg.optimizer.nesterov = false;
  cfg.optimizer.match_rms_adamw = true;
  cfg.optimizer.ns_steps = 3;
  cfg.optimizer.ns_bf16 = true;
  Engine a(cfg, world());
  a.add_group(adamw_options());
  zs_test::register_model(a, muon_model(), 1);
  zs_test::TrainOptions opt;
  opt.steps = 4;
  zs_test::train(a, opt);
  a.save(dir);
  Engine b(make_config({1, Tier::device}), world());  // torch's Muon settings
  b.add_group(adamw_options());
  zs_test::register_model(b, muon_model(), 1);
  b.load(dir);
  EXPECT_EQ(b.options(0).ns_steps, 3);
  EXPECT_TRUE(b.options(0).match_rms_adamw);
  EXPECT_TRUE(b.options(0).ns_bf16);
  EXPECT_FALSE(b.options(0).nesterov);
  zs_test::train(a, opt);
  zs_test::train(b, opt);
  for (int u = 0; u < a.num_units(); ++u)
    for (StateKind k : {StateKind::param, StateKind::master, StateKind::state0}) {
      const auto x = a.read_shard(u, k), y = b.read_shard(u, k);
      EXPECT_TRUE(same_bits(x, y)) << "unit " << u;
    }
  world()->barrier("muon checkpoint test: done");
  if (world()->rank() == 0) fs::remove_all(dir);
}

// A matrix no rank has a gradient for in a step is left as it is, momentum included (torch's
// rule for a .grad of None), while the others move; at stage 0 and stage 2.
TEST(MuonHeld, AMatrixWithoutAGradientStaysPut) {
  for (int stage : {0, 2}) {
    Engine e(make_config({stage}), world());
    e.add_group(adamw_options());
    zs_test::register_model(e, muon_model(), 1);
    zs_test::TrainOptions opt;
    opt.steps = 2;
    // The copying grads_ready() with a null view: layer0.w2 (unit 1, parameter 2) gets no
    // gradient in the second step, on any rank.
    opt.download = [](void* host, const void* dev, size_t bytes) { std::memcpy(host, dev, bytes); };
    opt.tamper = [](Engine&, int u, int, int64_t step, std::vector<TensorView>& g) {
      if (step == 1 && u == 1) g[2].data = nullptr;
    };
    std::vector<float> master, momentum, other;
    opt.before_step = [&](Engine& en) {
      if (en.step_count() != 1) return;
      master = en.read_full(1, 2, StateKind::master);
      momentum = en.read_full(1, 2, StateKind::state0);
      other = en.read_full(1, 0, StateKind::master);
    };
    zs_test::train(e, opt);
    EXPECT_TRUE(same_bits(e.read_full(1, 2, StateKind::master), master)) << "stage " << stage;
    EXPECT_TRUE(same_bits(e.read_full(1, 2, StateKind::state0), momentum)) << "stage " << stage;
    EXPECT_FALSE(same_bits(e.read_full(1, 0, StateKind::master), other)) << "stage " << stage;
  }
}

// The planner plans Muon's buffers as the engine holds them (plan_memory() is the engine's own
// set-up with nothing allocated): equal to the ledger, cell by cell and buffer by buffer, with
// the direction (the largest Muon unit's extent, f32) and, with more than one rank, the
// exchange: one matrix whole, the largest this rank orthogonalises, never a whole unit.
TEST(MuonMemory, PlanEqualsLedgerAndHoldsOneMatrixInFlight) {
  std::vector<PlanUnit> units;
  for (const auto& u : muon_model()) {
    PlanUnit pu{u.name, {}};
    for (const auto& [name, shape] : u.params)
      pu.params.push_back(Param{name, shape, name[0] == 'b' ? 1 : 0});
    units.push_back(pu);
  }
  for (int stage = 0; stage <= 3; ++stage)
    for (Tier tier : {Tier::device, Tier::host, Tier::nvme}) {
      if (stage == 0 && tier == Tier::nvme) continue;
      SCOPED_TRACE("stage " + std::to_string(stage) + ", optimizer " + tier_name(tier));
      const Config cfg = make_config({stage, tier});
      Engine e(cfg, world());
      e.add_group(adamw_options());
      zs_test::register_model(e, muon_model(), 1);
      const MemoryReport real = e.memory();
      const MemoryReport plan =
          plan_memory(cfg, units, e.world_size(), e.rank(), {adamw_options()});
      for (int t = 0; t < kNumTiers; ++t)
        for (int kd = 0; kd < kNumMemKinds; ++kd)
          EXPECT_EQ(plan.bytes[t][kd], real.bytes[t][kd]) << "tier " << t << " kind " << kd;
      ASSERT_EQ(plan.buffers.size(), real.buffers.size());
      int64_t extent = 0;  // of the largest unit holding a Muon matrix
      for (int u = 0; u < e.num_units(); ++u) {
        if (u == 3) continue;  // "tiny": its one vector is AdamW's
        const ShardInfo si = e.shard_info(u);
        extent = std::max(extent, stage == 0 ? si.padded_numel : si.shard_numel);
      }
      // The model's Muon matrices, in elements; the largest is 13 x 41.
      const std::vector<int64_t> matrices = {37 * 11, 11 * 23, 9 * 9, 4 * 15, 13 * 41};
      bool direction = false, exchange = false;
      int64_t scratch = 0;
      double exchanged = 0;
      for (size_t i = 0; i < plan.buffers.size(); ++i) {
        EXPECT_EQ(plan.buffers[i].name, real.buffers[i].name);
        EXPECT_EQ(plan.buffers[i].bytes, real.buffers[i].bytes) << real.buffers[i].name;
        if (real.buffers[i].name == "muon_direction") {
          direction = true;
          EXPECT_EQ(real.buffers[i].bytes, 4 * extent);
        }
        if (real.buffers[i].name == "muon_exchange") {
          exchange = true;
          exchanged = double(real.buffers[i].bytes);
          EXPECT_TRUE(std::count(matrices.begin(), matrices.end(), int64_t(exchanged) / 4) == 1 &&
                      int64_t(exchanged) % 4 == 0)
              << exchanged << " bytes are no matrix's";
        }
        // The iteration's, for the largest matrix this rank orthogonalises: 13 x 41 (2mn + 2m²
        // floats) on one rank; every rank owns one of the five matrices at up to 4 ranks.
        if (real.buffers[i].name == "muon_scratch") {
          scratch = real.buffers[i].bytes;
          EXPECT_LE(scratch, 4 * (2 * 13 * 41 + 2 * 13 * 13));
          if (e.world_size() == 1) {
            EXPECT_EQ(scratch, 4 * (2 * 13 * 41 + 2 * 13 * 13));
          }
        }
      }
      EXPECT_GT(scratch, 0);
      EXPECT_TRUE(direction);
      EXPECT_EQ(exchange, e.world_size() > 1);
      e.communicator()->all_reduce(&exchanged, 1, ReduceOp::max, "test")->wait();
      if (e.world_size() > 1) {
        EXPECT_EQ(exchanged, 4 * 13 * 41) << "no rank holds the largest";
      }
    }
}

// plan_choices() (what `zeroshard plan` prints) holds the rank that holds the most, whichever it
// is: Muon's exchange and scratch follow the matrices a rank orthogonalises. Here the small
// matrix goes to rank 0 and the large one to rank 1, the least busy then: at 3 ranks and more a
// middle rank holds the most, which a plan of ranks 0 and world - 1 alone misses.
TEST(MuonMemory, PlanChoicesHoldTheRankThatHoldsTheMost) {
  const std::vector<zs_test::UnitSpec> model = {{"small", {{"w", {10, 10}}}},
                                                {"large", {{"w", {40, 40}}, {"b", {40}}}}};
  std::vector<PlanUnit> units;
  for (const auto& u : model) {
    PlanUnit pu{u.name, {}};
    for (const auto& [name, shape] : u.params)
      pu.params.push_back(Param{name, shape, name[0] == 'b' ? 1 : 0});
    units.push_back(pu);
  }
  // Flat, and (at 4 ranks) groups of 2: a plan of one group's ranks holds every rank's most.
  const int w = world()->size();
  for (int group : w == 4 ? std::vector<int>{0, 2} : std::vector<int>{0})
    for (int stage = group > 0 ? 1 : 0; stage <= 3; ++stage) {
      SCOPED_TRACE("stage " + std::to_string(stage) + ", groups of " + std::to_string(group));
      Case run{stage, Tier::host};
      run.group = group;
      const Config cfg = make_config(run);
      Engine e(cfg, world());
      e.add_group(adamw_options());
      zs_test::register_model(e, model, 1);
      const MemoryReport real = e.memory();
      double most[kNumTiers];
      for (int t = 0; t < kNumTiers; ++t) {
        int64_t sum = 0;
        for (int kd = 0; kd < kNumMemKinds; ++kd) sum += real.bytes[t][kd];
        most[t] = double(sum);
      }
      e.communicator()->all_reduce(most, kNumTiers, ReduceOp::max, "test")->wait();
      bool found = false;
      for (const PlanChoice& c : plan_choices(cfg, units, e.world_size(), {adamw_options()}))
        if (c.stage == stage && c.optimizer == Tier::host && c.params == Tier::device) {
          found = true;
          for (int t = 0; t < kNumTiers; ++t) EXPECT_EQ(double(c.tier_bytes[t]), most[t]) << t;
        }
      EXPECT_TRUE(found);
    }
}
