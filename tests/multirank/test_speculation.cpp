// The speculative step (Config::speculative_step): with the optimizer state on the host or nvme
// tier, each unit's update runs during backward as if the step will neither overflow nor clip,
// and step() keeps it only where its own update would have read the same. Whatever the step
// finds, the result must be bitwise the step without speculation: here a schedule of steps that
// clip (clip_grad_norm below the norm), that do not (above it), that change the learning rate
// between backward and step(), that hold a parameter no rank gave a gradient, and (f16) that
// overflow, at every stage, dtype, accumulation and moment format, on both tiers, on 1–4 ranks.
#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <limits>

#include "tests/multirank/harness.hpp"

using namespace zeroshard;
using zs_test::world;

namespace {

struct Case {
  int stage;
  DType dtype;
  int micro;
  StateFormat state = StateFormat::f32;
  bool bf16_master = false;
  Tier tier = Tier::host;
  /// nvme: the gradient cache's slots, less one. 8 caches every unit (no eviction); 1 makes
  /// backward evict gradients that speculations read or are about to.
  int grad_buffers = 8;
  /// Gradients written on the host and handed over by copy (grads_ready(u, g)), so that one
  /// can be left out; else written into the engine's buffers (grads(u), then grads_ready(u)).
  bool host_grads = true;
};

std::string name_of(const Case& c) {
  return "stage" + std::to_string(c.stage) + "_" + dtype_name(c.dtype) + "_k" +
         std::to_string(c.micro) + "_state_" + state_format_name(c.state) +
         (c.bf16_master ? "_bf16master" : "") + "_" + tier_name(c.tier) +
         (c.tier == Tier::nvme ? "_cache" + std::to_string(c.grad_buffers + 1) : "") +
         (c.host_grads ? "" : "_engine_grads");
}

struct Result {
  std::vector<std::vector<float>> param, master, s0, s1;
  int taken = 0, kept = 0, dropped = 0;
  int64_t master_bytes = 0;  // the ledger's master bytes on the state's tier
};

constexpr int kSteps = 12;

// The optimizer state on the nvme tier, in a directory of this process's.
void swap_to_disk(Config& cfg) {
  cfg.offload_optimizer.tier = Tier::nvme;
  // The engine removes its run directory in it.
  cfg.offload_optimizer.nvme_paths = {zs_test::process_dir("spec-swap").string()};
  cfg.aio.block_size = 4096;
}

bool same(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * 4) == 0;
}

Result run(const Case& c, bool speculative) {
  Config cfg;
  cfg.stage = c.stage;
  cfg.dtype = c.dtype;
  cfg.gradient_accumulation_steps = c.micro;
  cfg.loss_scale.initial_scale_power = 8;
  cfg.optimizer.kind = OptimizerKind::adamw;
  cfg.optimizer.lr = 1e-2f;
  cfg.optimizer.weight_decay = 0.05f;
  cfg.shard_alignment = 4;
  cfg.collective_timeout_s = 120;
  cfg.offload_optimizer.tier = c.tier;
  if (c.tier == Tier::nvme) {
    swap_to_disk(cfg);
    cfg.grad_buffers = c.grad_buffers;
  }
  cfg.optimizer_state = c.state;
  cfg.state_block = 64;
  cfg.bf16_master = c.bf16_master;
  cfg.speculative_step = speculative ? SpeculativeStep::on : SpeculativeStep::off;
  Engine e(cfg, world());
  OptimizerOptions bias = e.config().optimizer;
  bias.weight_decay = 0.0f;
  bias.lr = 2e-2f;
  e.add_group(bias);
  zs_test::register_model(e, zs_test::uneven_model(), 1);
  Result r;
  r.master_bytes = e.memory().at(c.tier, MemKind::master);

  int64_t step = 0;
  zs_test::TrainOptions opt;
  opt.steps = kSteps;
  opt.micro_batches = c.micro;
  if (c.host_grads)
    opt.download = [](void* host, const void* dev, size_t bytes) { std::memcpy(host, dev, bytes); };
  std::vector<std::vector<float>> before;  // step 6: the masters before its backward
  opt.tamper = [&](Engine& en, int u, int micro, int64_t s, std::vector<TensorView>& g) {
    if (s == 6 && micro == 0 && u == en.num_units() - 1) {
      for (int v = 0; v < en.num_units(); ++v)
        before.push_back(en.read_shard(v, StateKind::master));
    }
    // Step 4: the last parameter of unit 2 gets no gradient on any rank (held by the step).
    if (s == 4 && u == 2 && c.host_grads) g.back().data = nullptr;
    // Step 7 (f16): one rank's gradient overflows, so the step is skipped.
    if (s == 7 && c.dtype == DType::f16 && en.rank() == 0 && micro == 0 && g[0].numel)
      zs_test::store(g[0].data, g[0].dtype, 0, std::numeric_limits<float>::infinity());
  };
  opt.before_step = [&](Engine& en) {
    if (step == 2) en.clip_grad_norm(1e-3);  // clips: every unit's speculation is dropped
    if (step == 3) en.clip_grad_norm(1e6);   // does not clip: kept
    if (step == 5) en.set_lr(0, 5e-3f);      // a scheduler between backward and step()
    if (step == 6) {  // what reads see between backward and step() is the last step's state
      for (int v = 0; v < en.num_units(); ++v)
        EXPECT_TRUE(same(en.read_shard(v, StateKind::master), before[size_t(v)])) << v;
    }
    if (step == 8) {  // a write between backward and step() drops its unit's speculation
      en.write_shard(1, StateKind::master, en.read_shard(1, StateKind::master));
      en.commit_shards();
    }
    ++step;
  };
  for (const StepResult& s : zs_test::train(e, opt)) {
    r.taken += !s.skipped;
    r.kept += s.speculation_kept;
    r.dropped += s.speculation_dropped;
  }
  for (int u = 0; u < e.num_units(); ++u) {
    r.param.push_back(e.read_shard(u, StateKind::param));
    r.master.push_back(e.read_shard(u, StateKind::master));
    r.s0.push_back(e.read_shard(u, StateKind::state0));
    r.s1.push_back(e.read_shard(u, StateKind::state1));
  }
  return r;
}

TEST(Speculation, EveryStepBitwiseTheStepWithout) {
  // The asynchronous device is a GPU's shape, which keeps stage 0's gradients on the device.
  const char* async = std::getenv("ZEROSHARD_ASYNC_DEVICE");
  const int first = async && std::string(async) == "1" ? 1 : 0;
  std::vector<Case> cases;
  for (int stage = first; stage <= 3; ++stage) {
    cases.push_back({stage, DType::f32, 1});
    cases.push_back({stage, DType::bf16, 2});
    cases.push_back({stage, DType::f16, 3});
  }
  cases.push_back({2, DType::bf16, 1, StateFormat::bf16});
  cases.push_back({3, DType::bf16, 2, StateFormat::q8, true});
  for (int stage = 1; stage <= 3; ++stage)  // the nvme tier needs stage >= 1
    cases.push_back(
        {stage, stage == 3 ? DType::f16 : DType::bf16, stage, StateFormat::f32, false, Tier::nvme});
  cases.push_back({3, DType::bf16, 2, StateFormat::q8, true, Tier::nvme});
  cases.push_back({2, DType::f16, 1, StateFormat::f32, false, Tier::nvme, 1});
  // The default cache (3 slots, fewer than the units), gradients in the engine's buffers: on a
  // GPU-shaped engine a unit's gradient slot is taken when its reduction starts, so backward
  // evicts units whose reduction has not landed; landing hands them to their speculation,
  // which must not read the slot given up (ThreadSanitizer saw it do so).
  for (int stage = 1; stage <= 3; ++stage)
    cases.push_back({stage, DType::bf16, 1, StateFormat::f32, false, Tier::nvme, 2, false});
  cases.push_back({3, DType::bf16, 3, StateFormat::bf16, false, Tier::nvme, 1});
  for (const Case& c : cases) {
    const Result ref = run(c, false), spec = run(c, true);
    const std::string what = name_of(c);
    EXPECT_EQ(ref.kept + ref.dropped, 0) << what;
    EXPECT_EQ(ref.taken, spec.taken) << what;
    EXPECT_EQ(spec.taken, c.dtype == DType::f16 ? kSteps - 1 : kSteps) << what;
    for (size_t u = 0; u < ref.param.size(); ++u) {
      EXPECT_TRUE(same(ref.param[u], spec.param[u])) << what << " unit " << u << " param";
      EXPECT_TRUE(same(ref.master[u], spec.master[u])) << what << " unit " << u << " master";
      EXPECT_TRUE(same(ref.s0[u], spec.s0[u])) << what << " unit " << u << " m";
      EXPECT_TRUE(same(ref.s1[u], spec.s1[u])) << what << " unit " << u << " v";
    }
    // Every unit speculated every step, kept or dropped. Dropped for certain: every unit at the
    // clipped step and at the overflow (f16). Kept for certain: every unit at the steps that
    // neither clip, overflow, hold a parameter, change the learning rate nor write. In between: a
    // unit speculated after set_lr() (its reduction completed in step()) has the new rate and is
    // kept; the held parameter drops its unit only on the rank whose shard holds it; the write
    // of step 8 drops its unit where it had speculated already. With a gradient cache smaller
    // than the model (nvme), backward also drops the speculations that have not started when
    // their gradient must make room: how many depends on timing.
    const int units = int(ref.param.size());
    const int f16 = c.dtype == DType::f16;
    const bool evicting = c.tier == Tier::nvme && c.grad_buffers + 1 < units;
    EXPECT_EQ(spec.kept + spec.dropped, kSteps * units) << what;
    EXPECT_GE(spec.dropped, (1 + f16) * units) << what;
    EXPECT_GE(spec.kept, evicting ? 1 : (kSteps - 4 - f16) * units) << what;
    // The host tier holds a second copy of the master weights, in the ledger; the nvme tier
    // writes the slot the step would write, and adds no disk space.
    EXPECT_GT(ref.master_bytes, 0) << what;
    EXPECT_EQ(spec.master_bytes, (c.tier == Tier::host ? 2 : 1) * ref.master_bytes) << what;
  }
}

// An engine destroyed between backward and step() (an exception, a stopped run) while its
// speculation thread still has units to update: their memory (on the asynchronous device, the
// pinned upload buffers; on the nvme tier, the swap slots its writes go from) must outlive the
// thread's work.
TEST(Speculation, EngineDestroyedBetweenBackwardAndStep) {
  for (int stage : {2, 3, -2, -3}) {  // negative: on the nvme tier (its writes still in flight)
    Config cfg;
    cfg.stage = std::abs(stage);
    cfg.dtype = DType::bf16;
    cfg.offload_optimizer.tier = Tier::host;
    if (stage < 0) swap_to_disk(cfg);
    cfg.speculative_step = SpeculativeStep::on;
    cfg.collective_timeout_s = 120;
    auto e = std::make_unique<Engine>(cfg, world());
    for (int u = 0; u < 6; ++u) e->add_unit("u" + std::to_string(u), {Param{"w", {1 << 20}}});
    e->finalize();
    std::vector<uint16_t> g(size_t(1) << 20, 0x3c00);  // bf16 1.0
    for (int u = 5; u >= 0; --u) e->grads_ready(u, {TensorView{g.data(), 1 << 20, DType::bf16}});
    e.reset();  // no step(): the thread may be anywhere in its six units
  }
}

}  // namespace
