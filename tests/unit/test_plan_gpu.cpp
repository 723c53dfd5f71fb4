// plan_memory() of a GPU engine (Config::device cuda) on a machine without a GPU: the same
// setup as the CPU engine's plus the GPU's own staging, and nothing else. That the plan equals a
// real GPU engine's ledger is checked in every case of tests/gpu/test_gpu_engine.cpp's
// GpuEngine.MatchesTheCpuEngine.
#include <gtest/gtest.h>

#include <array>
#include <map>
#include <string>
#include <utility>

#include "zeroshard/calibration.hpp"
#include "zeroshard/device.hpp"
#include "zeroshard/zeroshard.hpp"

using namespace zeroshard;

namespace {

// Two units of 4096 and 1000 bf16 parameters: on 2 ranks, shards of 2048 and 512 elements (the
// second padded from 1000 to 1024).
std::vector<PlanUnit> model() {
  return {{"a", {Param{"w", {64, 64}}}}, {"b", {Param{"v", {1000}}}}};
}
constexpr int64_t kShards[] = {2048, 512};
constexpr int64_t kLargest = 2048;

// Bytes per (buffer name, tier): a buffer kept per unit is listed once per unit.
std::map<std::pair<std::string, Tier>, int64_t> named(const MemoryReport& m) {
  std::map<std::pair<std::string, Tier>, int64_t> out;
  for (const NamedBuffer& b : m.buffers) out[{b.name, b.tier}] += b.bytes;
  return out;
}

}  // namespace

// Every choice a GPU engine takes, on 2 ranks: the GPU plan is the CPU plan with, where the
// optimizer is off the GPU, the gradient shards' staging slots on the GPU (Config::grad_buffers
// of the largest shard) and, where the parameters stay on the GPU, a pinned upload buffer of
// each unit's shard; and where stage 3's shards are off the GPU, two slots on the GPU they are
// copied up into before their gathers. Each tier × kind differs by exactly those bytes. And
// one more: speculative_step left to the engine ("auto") takes it on the GPU with the optimizer
// on nvme, whose new shards go into a second set of upload buffers (parameters on the GPU) or
// into host buffers of their own (stage 3's shards in host memory).
TEST(PlanGpu, IsTheCpuPlanWithTheGpusStaging) {
  int planned = 0;
  for (int stage = 0; stage <= 3; ++stage)
    for (Tier opt : {Tier::device, Tier::host, Tier::nvme})
      for (Tier par : {Tier::device, Tier::host, Tier::nvme}) {
        if ((stage < 3 && par != Tier::device) || (stage == 0 && opt != Tier::device)) continue;
        if (par != Tier::device && opt == Tier::device) continue;  // the engine refuses these
        Config cfg;
        cfg.stage = stage;
        cfg.dtype = DType::bf16;
        cfg.offload_optimizer.tier = opt;
        cfg.offload_param.tier = par;
        cfg.offload_optimizer.nvme_paths = cfg.offload_param.nvme_paths = {"nvme"};
        SCOPED_TRACE("stage " + std::to_string(stage) + ", optimizer " + tier_name(opt) +
                     ", parameters " + tier_name(par));
        const MemoryReport cpu = plan_memory(cfg, model(), 2);
        cfg.device = Device::cuda;
        const MemoryReport gpu = plan_memory(cfg, model(), 2);

        std::map<std::pair<std::string, Tier>, int64_t> want = named(cpu);
        std::array<std::array<int64_t, kNumMemKinds>, kNumTiers> extra{};  // GPU-only bytes
        auto add = [&](const char* name, Tier t, int64_t bytes) {
          want[{name, t}] += bytes;
          extra[int(t)][int(MemKind::buffer)] += bytes;
        };
        if (opt != Tier::device) {
          add("grad_shard_staging", Tier::device, cfg.grad_buffers * kLargest * 2);
          if (par == Tier::device)
            for (int64_t s : kShards) add("param_upload", Tier::host, s * 2);
        }
        if (stage == 3 && par != Tier::device)
          add("param_shard_staging", Tier::device, 2 * kLargest * 2);
        if (opt == Tier::nvme && par != Tier::nvme)
          for (int64_t s : kShards)
            add(par == Tier::device ? "param_upload_speculative" : "param_speculative", Tier::host,
                s * 2);
        EXPECT_EQ(named(gpu), want);
        for (int t = 0; t < kNumTiers; ++t)
          for (int k = 0; k < kNumMemKinds; ++k)
            EXPECT_EQ(gpu.bytes[t][k], cpu.bytes[t][k] + extra[t][k])
                << tier_name(Tier(t)) << " " << mem_kind_name(MemKind(k));
        ++planned;
      }
  EXPECT_EQ(planned, 14);
}

// plan_choices() lists only what a GPU engine takes: no stage 0 with the optimizer off the GPU,
// no parameters off the GPU with the optimizer on it. A base no choice takes is refused with the
// engine's own reason.
TEST(PlanGpu, ChoicesAreTheOnesTheGpuEngineTakes) {
  Config base;
  base.dtype = DType::bf16;
  base.device = Device::cuda;
  const std::vector<PlanChoice> choices = plan_choices(base, model(), 2);
  EXPECT_EQ(choices.size(), 14u);  // 15 of a CPU engine, less stage 0 on the host
  for (const PlanChoice& c : choices) {
    EXPECT_FALSE(c.stage == 0 && c.optimizer != Tier::device);
    EXPECT_FALSE(c.params != Tier::device && c.optimizer == Tier::device);
    EXPECT_EQ(c.config.device, Device::cuda);
  }
  base.shard_alignment = 4;  // the GPU update's vector accesses need multiples of 8
  try {
    plan_choices(base, model(), 2);
    FAIL() << "a base no GPU engine takes was planned";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("shard_alignment"), std::string::npos) << e.what();
  }
}

// time_pcie() copies through a GPU engine's own backend: without a usable GPU it is refused
// with the runtime's reason (Error, not a crash or a rate of nothing); with one, both
// directions are measured.
TEST(PlanGpu, PcieIsTimedOnAGpuOrRefused) {
  std::string why;
  if (cuda_device_count(&why) == 0) {
    try {
      time_pcie(-1, 1 << 20, 1);
      FAIL() << "timed PCIe without a GPU";
    } catch (const Error& e) {
      EXPECT_TRUE(e.code() == ErrorCode::cuda_error || e.code() == ErrorCode::invalid_config)
          << e.what();
      EXPECT_FALSE(std::string(e.what()).empty());
    }
    return;
  }
  const PcieRates r = time_pcie(-1, 64 << 20, 3);
  EXPECT_GT(r.h2d_gbs, 1);
  EXPECT_GT(r.d2h_gbs, 1);
}

// time_update() issues the fused update through the engine's backend, with every array its
// format needs in that backend's memory: on the CPU every moment format and a bf16 master run
// (a q8 state without its absmax arrays, or a bf16 master read as f32, would crash or throw);
// on a GPU the same, else the runtime's reason. A configuration the engine refuses is refused.
TEST(PlanGpu, UpdateIsTimedOnTheEnginesBackend) {
  for (StateFormat f : {StateFormat::f32, StateFormat::bf16, StateFormat::q8})
    for (bool bf16_master : {false, true}) {
      Config c;
      c.dtype = DType::bf16;
      c.optimizer_state = f;
      c.bf16_master = bf16_master;
      const double s = time_update(c, 100000, 2);  // rounded up to whole 2048-element blocks
      EXPECT_TRUE(s > 0 && s < 10) << state_format_name(f) << " " << bf16_master << ": " << s;
    }
  Config bad;
  bad.dtype = DType::f32;
  bad.bf16_master = true;  // a bf16 master needs bf16 parameters
  EXPECT_THROW(time_update(bad, 1000, 1), Error);
  EXPECT_THROW(time_update(Config{}, 0, 1), Error);
  Config gpu;
  gpu.device = Device::cuda;
  if (cuda_device_count() == 0) {
    EXPECT_THROW(time_update(gpu, 1 << 20, 1), Error);
  } else {
    for (StateFormat f : {StateFormat::f32, StateFormat::bf16, StateFormat::q8}) {
      gpu.optimizer_state = f;
      EXPECT_GT(time_update(gpu, 1 << 22, 3), 0) << state_format_name(f);
    }
  }
}
