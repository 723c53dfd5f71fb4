// The engine on a GPU against the engine on the CPU, under mpirun (every rank on GPU 0, so 2
// ranks share one GPU through the MPI communicator's staging of device buffers; at one rank
// also over NCCL). In a build without MPI it runs as one rank over the one-rank communicator. Both
// engines train the same model on the same gradients, one after the other on the same communicator,
// and every shard of every state must come out the same:
// - bitwise without clipping: the CUDA update, cast and accumulate kernels are bitwise equal to
//   the CPU kernels, and the reductions see the same bytes (MPI sums them on the host either
//   way; NCCL at one rank does not add);
// - within 1e-6 with clipping, whose factor comes from the gradient norm, which the GPU sums in
//   another order (relative error below 1e-12, see kernels/cuda/cuda_kernels.hpp), so the
//   factor and everything downstream may differ in the last bits.
// Without a GPU every rank skips with the CUDA runtime's reason.

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "tests/gpu/gpu_test_util.hpp"
#include "tests/multirank/harness.hpp"
#include "zeroshard/zeroshard.hpp"

namespace zeroshard {
namespace {

using zs_test::world;

struct Case {
  int stage;
  DType dtype;
  Tier optimizer_tier;
  int micro;
  double clip;
  bool nccl;                             // one rank over NCCL instead of MPI
  Tier param_tier = Tier::device;        // stage 3's parameter shards (offload_param)
  StateFormat state = StateFormat::f32;  // the moments' format (Config::optimizer_state)
};

std::string name(const Case& c) {
  return "stage" + std::to_string(c.stage) + "_" + dtype_name(c.dtype) + "_" +
         tier_name(c.optimizer_tier) + "_k" + std::to_string(c.micro) +
         (c.clip > 0 ? "_clip" : "") + (c.nccl ? "_nccl" : "_mpi") +
         (c.param_tier != Tier::device ? std::string("_params_") + tier_name(c.param_tier) : "") +
         (c.state != StateFormat::f32 ? std::string("_moments_") + state_format_name(c.state) : "");
}

// Swap files go where TMPDIR points (a real disk, through io_uring), else /tmp.
std::string swap_dir() {
  const char* t = std::getenv("TMPDIR");
  return t && *t ? t : "/tmp";
}

Config config(const Case& c, Device d) {
  Config cfg;
  cfg.stage = c.stage;
  cfg.dtype = c.dtype;
  cfg.device = d;
  cfg.device_index = 0;
  cfg.offload_optimizer.tier = c.optimizer_tier;
  if (c.optimizer_tier == Tier::nvme) cfg.offload_optimizer.nvme_paths = {swap_dir()};
  cfg.offload_param.tier = c.param_tier;
  if (c.param_tier == Tier::nvme) cfg.offload_param.nvme_paths = {swap_dir()};
  cfg.optimizer_state = c.state;
  cfg.state_block = 256;  // several 8-bit blocks per unit, some holding two parameters
  cfg.gradient_accumulation_steps = c.micro;
  cfg.gradient_clipping = c.clip;
  cfg.optimizer.lr = 1e-2f;
  cfg.max_live_units = 2;
  cfg.collective_timeout_s = 30;  // a failing rank must not hold the others for long
  return cfg;
}

// plan_memory() of a GPU engine runs its setup on a stand-in GPU that allocates nothing: on the
// machine with the GPU, the plan must be the real engine's ledger, cell by cell and buffer by
// buffer (tests/unit/test_plan_gpu.cpp checks the plan without a GPU).
void expect_plan_is_ledger(const Config& cfg, const std::vector<zs_test::UnitSpec>& model,
                           const Engine& e) {
  std::vector<PlanUnit> units;
  for (const auto& u : model) {
    PlanUnit pu{u.name, {}};
    for (const auto& [pname, shape] : u.params) pu.params.push_back(Param{pname, shape});
    units.push_back(pu);
  }
  const MemoryReport real = e.memory();
  const MemoryReport plan = plan_memory(cfg, units, e.world_size(), e.rank());
  for (int t = 0; t < kNumTiers; ++t)
    for (int k = 0; k < kNumMemKinds; ++k)
      EXPECT_EQ(plan.bytes[t][k], real.bytes[t][k])
          << "plan of " << tier_name(Tier(t)) << " " << mem_kind_name(MemKind(k));
  ASSERT_EQ(plan.buffers.size(), real.buffers.size());
  for (size_t i = 0; i < plan.buffers.size(); ++i)
    EXPECT_EQ(plan.buffers[i].bytes, real.buffers[i].bytes) << "plan of " << real.buffers[i].name;
}

// The trainer's copies of TrainOptions (upload, download): on `s`, after the engine's work there,
// waited for.
auto copy_on(cudaStream_t s) {
  return [s](void* dst, const void* src, size_t bytes) {
    ZS_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, s));
    ZS_CUDA_CHECK(cudaStreamSynchronize(s));
  };
}

class GpuEngine : public ::testing::TestWithParam<Case> {};

TEST_P(GpuEngine, MatchesTheCpuEngine) {
  ZS_REQUIRE_GPU();
  const Case c = GetParam();
  if (c.nccl && world()->size() > 1) GTEST_SKIP() << "NCCL allows one rank per GPU";
  zs_test::TrainOptions opt;
  opt.steps = 6;
  opt.micro_batches = c.micro;
  const auto model = zs_test::uneven_model();

  std::unique_ptr<Engine> cpu_owner;
  try {
    cpu_owner = std::make_unique<Engine>(config(c, Device::cpu), world());
  } catch (const Error& e) {
    if ((c.optimizer_tier == Tier::nvme || c.param_tier == Tier::nvme) &&
        e.code() == ErrorCode::invalid_config)
      GTEST_SKIP() << e.what();  // a build without io_uring (a bare GPU machine)
    throw;
  }
  Engine& cpu_e = *cpu_owner;
  zs_test::register_model(cpu_e, model);
  const std::vector<StepResult> want = zs_test::train(cpu_e, opt);

  std::shared_ptr<Communicator> comm =
      c.nccl ? make_nccl_communicator(0, make_self_communicator()) : world();
  Engine gpu_e(config(c, Device::cuda), comm);
  zs_test::register_model(gpu_e, model);
  expect_plan_is_ledger(config(c, Device::cuda), model, gpu_e);
  ASSERT_NE(gpu_e.stream(), nullptr);
  // Reads follow the engine's work on its stream (stage 0's update returns without waiting).
  auto stream = static_cast<cudaStream_t>(gpu_e.stream());
  opt.download = copy_on(stream);
  const std::vector<StepResult> got = zs_test::train(gpu_e, opt);

  ASSERT_EQ(got.size(), want.size());
  for (size_t s = 0; s < got.size(); ++s) {
    EXPECT_EQ(got[s].skipped, want[s].skipped) << "step " << s;
    EXPECT_EQ(got[s].loss_scale, want[s].loss_scale) << "step " << s;
    if (!want[s].skipped) {
      EXPECT_NEAR(got[s].grad_norm, want[s].grad_norm, 1e-9 * want[s].grad_norm) << "step " << s;
    }
  }
  const double bound = c.clip > 0 ? 1e-6 : 0.0;
  for (int u = 0; u < cpu_e.num_units(); ++u) {
    for (StateKind k :
         {StateKind::param, StateKind::master, StateKind::state0, StateKind::state1}) {
      if (!cpu_e.has_state(k)) continue;
      const std::vector<float> a = cpu_e.read_shard(u, k), b = gpu_e.read_shard(u, k);
      ASSERT_EQ(a.size(), b.size());
      double worst = 0;
      for (size_t i = 0; i < a.size(); ++i) worst = std::max(worst, double(std::fabs(a[i] - b[i])));
      if (bound == 0) {
        EXPECT_EQ(std::memcmp(a.data(), b.data(), a.size() * 4), 0)
            << "unit " << u << " state " << int(k) << " differs (worst " << worst << ")";
      } else {
        EXPECT_LE(worst, bound) << "unit " << u << " state " << int(k);
      }
    }
  }
  // Same layout, same bytes: only the staging buffers differ between the two backends.
  EXPECT_EQ(gpu_e.memory().model_state_bytes(), cpu_e.memory().model_state_bytes());
  // Views of a GPU engine say where they live.
  const std::vector<TensorView> v = gpu_e.gather(0);
  EXPECT_EQ(v[0].device, Device::cuda);
  gpu_e.release(0);
}

std::vector<Case> cases() {
  std::vector<Case> out;
  for (int stage : {0, 1, 2, 3})
    for (DType dt : {DType::f32, DType::bf16})
      for (Tier t : {Tier::device, Tier::host}) {
        if (stage == 0 && t == Tier::host) continue;  // not offered on a GPU (Config::validate)
        out.push_back({stage, dt, t, 1, 0.0, false});
      }
  for (int stage : {1, 3}) out.push_back({stage, DType::bf16, Tier::nvme, 1, 0.0, false});
  out.push_back({2, DType::f32, Tier::nvme, 2, 0.0, false});
  out.push_back({2, DType::bf16, Tier::device, 2, 0.0, false});
  out.push_back({3, DType::bf16, Tier::host, 2, 0.0, false});
  out.push_back({1, DType::f16, Tier::device, 1, 0.0, false});
  out.push_back({2, DType::f32, Tier::device, 1, 0.5, false});
  out.push_back({3, DType::bf16, Tier::host, 1, 0.5, false});
  for (int stage : {0, 3}) out.push_back({stage, DType::bf16, Tier::device, 1, 0.0, true});
  out.push_back({2, DType::bf16, Tier::host, 1, 0.0, true});
  // Stage 3's parameters off the GPU (ZeRO-Infinity's parameter tier): in host memory or on
  // disk, with the optimizer in host memory or on disk; f32 on the host aliases master and
  // parameters; accumulation; and over NCCL.
  for (Tier p : {Tier::host, Tier::nvme})
    for (Tier o : {Tier::host, Tier::nvme}) out.push_back({3, DType::bf16, o, 1, 0.0, false, p});
  out.push_back({3, DType::f32, Tier::host, 1, 0.0, false, Tier::host});
  out.push_back({3, DType::bf16, Tier::host, 2, 0.5, false, Tier::host});
  out.push_back({3, DType::bf16, Tier::host, 1, 0.0, true, Tier::nvme});
  // Compact moments in GPU memory (kernels/cuda/update.cu for bf16, update_q8.cu for 8-bit).
  for (StateFormat f : {StateFormat::bf16, StateFormat::q8}) {
    for (int stage : {0, 1, 2, 3})
      out.push_back({stage, DType::bf16, Tier::device, 1, 0.0, false, Tier::device, f});
    out.push_back({2, DType::f32, Tier::device, 2, 0.0, false, Tier::device, f});
    out.push_back({3, DType::bf16, Tier::device, 1, 0.0, true, Tier::device, f});
  }
  return out;
}

INSTANTIATE_TEST_SUITE_P(All, GpuEngine, ::testing::ValuesIn(cases()),
                         [](const ::testing::TestParamInfo<Case>& i) { return name(i.param); });

// The trainer's own stream (set_stream) and gradients written straight into the engine's device
// buffers on it, the path a real GPU trainer takes: the same results as the CPU engine.
TEST(GpuEngineStreams, TrainerStreamAndDeviceGradients) {
  ZS_REQUIRE_GPU();
  for (int stage : {0, 2, 3}) {
    SCOPED_TRACE("stage " + std::to_string(stage));
    const Case c{stage, DType::bf16, Tier::device, 1, 0.0, false};
    zs_test::TrainOptions opt;
    opt.steps = 4;
    const auto model = zs_test::uneven_model();
    Engine cpu_e(config(c, Device::cpu), world());
    zs_test::register_model(cpu_e, model);
    zs_test::train(cpu_e, opt);

    Engine gpu_e(config(c, Device::cuda), world());
    zs_test::register_model(gpu_e, model);
    cudaStream_t mine = nullptr;
    ZS_CUDA_CHECK(cudaStreamCreateWithFlags(&mine, cudaStreamNonBlocking));
    gpu_e.set_stream(mine);
    ASSERT_EQ(gpu_e.stream(), static_cast<void*>(mine));
    // Host memory the uploads read stays alive until the stream has passed them.
    opt.upload = copy_on(mine);
    opt.download = copy_on(mine);
    zs_test::train(gpu_e, opt);
    for (int u = 0; u < cpu_e.num_units(); ++u)
      for (StateKind k : {StateKind::param, StateKind::master, StateKind::state0}) {
        const std::vector<float> a = cpu_e.read_shard(u, k), b = gpu_e.read_shard(u, k);
        EXPECT_EQ(std::memcmp(a.data(), b.data(), a.size() * 4), 0) << "unit " << u;
      }
    gpu_e.set_stream(nullptr);  // before the stream goes
    ZS_CUDA_CHECK(cudaStreamDestroy(mine));
  }
}

// Muon on a GPU engine against the CPU engine: with the state on the GPU (the GPU's average,
// bitwise, and its cuBLAS iteration, close to OpenBLAS's: the same products summed in another
// order) and offloaded to the host (the CPU's kernels on both: bitwise).
TEST(GpuEngineMuon, MatchesTheCpuEngine) {
  ZS_REQUIRE_GPU();
  const std::vector<zs_test::UnitSpec> model = {
      {"embed", {{"w", {37, 11}}}},
      {"layer", {{"w", {11, 23}}, {"b", {23}}, {"w2", {9, 9}}}},
      {"head", {{"w", {13, 41}}, {"b", {41}}}},
  };
  struct Where {
    int stage;
    Tier tier;
    bool nccl;  // one rank over NCCL, as a one-GPU job runs, instead of MPI
  };
  for (Where w :
       {Where{0, Tier::device, false}, Where{1, Tier::device, false}, Where{1, Tier::host, false},
        Where{3, Tier::device, false}, Where{3, Tier::host, false}, Where{3, Tier::device, true}})
    for (StateFormat f : {StateFormat::f32, StateFormat::q8}) {
      if (w.nccl && world()->size() > 1) continue;  // NCCL allows one rank per GPU
      const int stage = w.stage;
      const Tier tier = w.tier;
      SCOPED_TRACE("stage " + std::to_string(stage) + ", " + tier_name(tier) + ", moments " +
                   state_format_name(f) + (w.nccl ? ", NCCL" : ""));
      const Case c{stage, DType::bf16, tier, 1, 0.0, w.nccl, Tier::device, f};
      auto muon_config = [&](Device d) {
        Config cfg = config(c, d);
        cfg.optimizer.kind = OptimizerKind::muon;
        cfg.optimizer.lr = 2e-2f;
        cfg.optimizer.momentum = 0.95f;
        cfg.optimizer.nesterov = true;
        cfg.shard_alignment = 8;  // shards cut through matrices
        return cfg;
      };
      OptimizerOptions adamw;
      adamw.kind = OptimizerKind::adamw;
      adamw.lr = 1e-2f;
      zs_test::TrainOptions opt;
      opt.steps = 6;
      Engine cpu_e(muon_config(Device::cpu), world());
      cpu_e.add_group(adamw);
      zs_test::register_model(cpu_e, model, 1);
      zs_test::train(cpu_e, opt);
      Engine gpu_e(muon_config(Device::cuda),
                   w.nccl ? make_nccl_communicator(0, make_self_communicator()) : world());
      gpu_e.add_group(adamw);
      zs_test::register_model(gpu_e, model, 1);
      auto stream = static_cast<cudaStream_t>(gpu_e.stream());
      opt.download = copy_on(stream);
      zs_test::train(gpu_e, opt);
      // On the GPU the directions differ in the last bits, and so do the gradients after
      // (they depend on the parameters): the parameters move 2e-2 × O(1) a step, so 1e-3 is
      // a small fraction of six steps and far below a wrong iteration's error. An 8-bit
      // momentum may then round to the next code here and there: a few % of its largest.
      // The parameters are bf16: a master 1e-3 off may round to the next bf16 value (2^-8
      // relative). A NaN fails (the comparison is false), as any wrong value does.
      for (int u = 0; u < cpu_e.num_units(); ++u)
        for (StateKind k : {StateKind::param, StateKind::master, StateKind::state0}) {
          const std::vector<float> a = cpu_e.read_shard(u, k), b = gpu_e.read_shard(u, k);
          ASSERT_EQ(a.size(), b.size());
          double top = 0;
          for (float x : a) top = std::max(top, double(std::fabs(x)));
          int64_t off = 0;
          for (size_t i = 0; i < a.size(); ++i) {
            double bound = 0;  // the host tier: the CPU's kernels on both, bitwise
            if (tier == Tier::device && k == StateKind::state0)
              bound = f == StateFormat::q8 ? 5e-2 * top : 1e-4;
            else if (tier == Tier::device)
              bound = 1e-3 + (k == StateKind::param ? std::ldexp(std::fabs(a[i]), -7) : 0.0);
            off += !(std::fabs(double(a[i]) - double(b[i])) <= bound);
          }
          EXPECT_EQ(off, 0) << "unit " << u << " state " << int(k) << ": elements out of bounds";
        }
    }
}

TEST(GpuEngineConfig, RejectsWhatTheGpuEngineDoesNotDo) {
  Config c;
  c.device = Device::cuda;
  c.stage = 3;
  c.offload_param.tier = Tier::host;
  EXPECT_ZS_ERROR(c.validate(), invalid_config, "requires zero_optimization.offload_optimizer");
  c.offload_optimizer.tier = Tier::host;
  EXPECT_NO_THROW(c.validate());  // ZeRO-Infinity's parameter tier
  c.offload_optimizer = {};
  c.offload_param = {};
  c.stage = 0;
  c.offload_optimizer.tier = Tier::host;
  EXPECT_ZS_ERROR(c.validate(), invalid_config, "requires zero_optimization.stage >= 1");
  c.offload_optimizer = {};
  c.shard_alignment = 12;
  EXPECT_ZS_ERROR(c.validate(), invalid_config, "multiple of 8");
}

}  // namespace
}  // namespace zeroshard
