// The asynchronous CPU device (src/compute/async_cpu_device.cpp): its kernels are bitwise the
// synchronous CPU backend's; an engine on it takes the GPU's paths (staging slots in its ledger)
// and trains to bitwise the same parameters, also with the trainer on streams of its own
// (AsyncTrainerStream, as torch on a GPU); it is selected by config or environment, and takes
// what a GPU takes. That it catches missing waits is shown by scripts/mutate_waits.py.

#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "base/ledger.hpp"
#include "kernels/cpu/arena.hpp"
#include "src/compute/compute.hpp"
#include "src/tiers/memory_state_tier.hpp"
#include "src/tiers/staged_state_tier.hpp"
#include "zeroshard/zeroshard.hpp"

namespace zeroshard {
namespace {

std::vector<float> random_floats(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.0f, 1.0f);
  std::vector<float> v(n);
  for (float& x : v) x = d(rng);
  return v;
}

bool same_bits(const void* a, const void* b, size_t bytes) {
  return std::memcmp(a, b, bytes) == 0;
}

// Sets an environment variable for one test and restores it after.
class EnvVar {
 public:
  EnvVar(const char* name, const char* value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old, had_ = true;
    ::setenv(name, value, 1);
  }
  ~EnvVar() {
    if (had_)
      ::setenv(name_, old_.c_str(), 1);
    else
      ::unsetenv(name_);
  }

 private:
  const char* name_;
  std::string old_;
  bool had_ = false;
};

TEST(AsyncDevice, KernelsMatchTheCpuBackendBitwise) {
  cpu::Arena arena(2);
  auto sync = make_cpu_compute(arena);
  auto async = make_async_cpu_compute(arena, 7, 200);
  EXPECT_TRUE(async->streams());
  EXPECT_FALSE(sync->streams());
  EXPECT_EQ(async->device(), Device::cpu);
  EXPECT_EQ(async->stream(), nullptr);

  const size_t n = 300001;  // several arena chunks and a tail
  const std::vector<float> x = random_floats(n, 1), g = random_floats(n, 2);
  std::vector<uint16_t> low_s(n), low_a(n);
  sync->convert(x.data(), DType::f32, low_s.data(), DType::bf16, int64_t(n));
  async->convert(x.data(), DType::f32, low_a.data(), DType::bf16, int64_t(n));
  std::vector<float> acc_s = x, acc_a = x;
  sync->accumulate(acc_s.data(), g.data(), DType::f32, int64_t(n));
  async->accumulate(acc_a.data(), g.data(), DType::f32, int64_t(n));
  const std::vector<GradSpan> spans = {{g.data(), DType::f32, int64_t(n)},
                                       {low_s.data(), DType::bf16, int64_t(n / 3)}};
  const auto ss = sync->sum_squares(spans);
  const auto sa = async->sum_squares(spans);  // waits: the accumulate and convert are done
  EXPECT_TRUE(same_bits(low_s.data(), low_a.data(), n * 2));
  EXPECT_TRUE(same_bits(acc_s.data(), acc_a.data(), n * 4));
  EXPECT_EQ(ss.first, sa.first);
  EXPECT_GT(sa.first, 0.0);
  EXPECT_FALSE(sa.second);

  // A non-finite gradient raises the flag, as on the CPU.
  std::vector<float> bad = g;
  bad[n / 2] = INFINITY;
  EXPECT_TRUE(async->sum_squares({{bad.data(), DType::f32, int64_t(n)}}).second);
}

TEST(AsyncDevice, CopiesAndDownloadsLandBeforeTheHostReads) {
  cpu::Arena arena(2);
  auto dev = make_async_cpu_compute(arena, 3, 300);
  const size_t n = 1 << 16;
  std::vector<float> src = random_floats(n, 3), mid(n, 0.0f), dst(n, 0.0f);
  dev->fill(mid.data(), 0xFF, n * 4);
  dev->copy(mid.data(), src.data(), n * 4);  // after the fill, in issue order
  dev->convert(mid.data(), DType::f32, mid.data(), DType::f32, int64_t(n));  // a no-op
  dev->synchronize();
  dev->download(dst.data(), mid.data(), n * 4);
  EXPECT_TRUE(same_bits(dst.data(), src.data(), n * 4));
  EXPECT_THROW(dev->set_stream(reinterpret_cast<void*>(1)), Error);
}

// Work still queued when the device goes would touch freed memory: the device aborts, naming it.
TEST(AsyncDeviceDeathTest, DestroyedWithWorkInFlightAborts) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_DEATH(
      {
        cpu::Arena arena(1);
        std::vector<char> buf(1 << 20);
        auto dev = make_async_cpu_compute(arena, 1, 200000);  // up to 0.2 s before each piece
        for (int i = 0; i < 8; ++i) dev->fill(buf.data(), 1, buf.size());
      },
      "destroyed with [0-9]+ piece\\(s\\) of work in flight");
}

// One unit of three parameters trained for a few steps on a one-rank engine.
struct Trained {
  std::vector<float> params;
  std::vector<float> full;  // every parameter's master weights whole, read after the last step
  MemoryReport memory;
};

// Two units of a stage-2 bf16 model (3000 and 3017 elements), as the state tiers take them,
// their buffers in `dev`'s memory (pinned host buffers in its pinned memory).
struct TwoUnits {
  Config cfg;
  std::vector<UnitShape> units = std::vector<UnitShape>(2);
  Ledger ledger;
  TierContext ctx;
  explicit TwoUnits(Compute& dev) {
    cfg.stage = 2;
    cfg.dtype = DType::bf16;  // the master weights are a buffer of their own
    for (int i = 0; i < 2; ++i) {
      UnitShape& u = units[size_t(i)];
      u.layout.name = "u" + std::to_string(i);
      u.layout.numel = u.layout.padded_numel = u.layout.shard_numel = 3000 + 17 * i;
      u.whole_runs = u.shard_runs = {{0, u.layout.shard_numel, 0}};
    }
    ctx.cfg = &cfg;
    ctx.units = &units;
    ctx.pdt = DType::bf16;
    ctx.pbytes = 2;
    ctx.num_states = 2;
    ctx.ledger = &ledger;
    ctx.buffer = [this, &dev](Tier t, MemKind k, const char* name, size_t bytes, bool pin) {
      return Buffer(&ledger, t, k, name, bytes,
                    t == Tier::device ? dev.device_memory()
                    : pin             ? dev.pinned_memory()
                                      : nullptr);
    };
    ctx.finish_reduction = [](int) {};
  }
};

// A state tier's own contract, whatever the tier after it does: once load_initial(u, whole)
// returns, the caller may refill `whole` (the engine reuses one array for every unit), so the
// copy into the device's master weights must have read it by then.
TEST(AsyncDevice, StateTierLoadHasReadTheInitialValuesWhenItReturns) {
  cpu::Arena arena(1);
  const std::unique_ptr<Compute> dev = make_async_cpu_compute(arena, 7, 2000);
  TwoUnits m(*dev);
  const TierContext& ctx = m.ctx;
  MemoryStateTier tier(ctx, Tier::device, *dev, arena, {std::nullopt, std::nullopt}, false,
                       Speculative::off);
  std::vector<float> whole(3017);
  std::vector<std::vector<float>> want;
  for (int u = 0; u < 2; ++u) {
    want.push_back(random_floats(size_t(ctx.shard(u)), uint32_t(40 + u)));
    std::copy(want.back().begin(), want.back().end(), whole.begin());
    tier.load_initial(u, whole.data());
    std::fill(whole.begin(), whole.end(), NAN);  // refilled at once, as the engine may
  }
  for (int u = 0; u < 2; ++u) {
    const std::vector<float> got = tier.read(u, StateKind::master);
    ASSERT_EQ(got.size(), want[size_t(u)].size());
    EXPECT_TRUE(same_bits(got.data(), want[size_t(u)].data(), got.size() * 4)) << "unit " << u;
  }
}

// A parameter shard as the trainer reads it after each update (bf16 bits), per update and unit.
using Reads = std::vector<std::vector<std::vector<uint16_t>>>;

// Three updates of two units by a staged state tier (the host tier under a GPU) on the
// asynchronous device. The gradients are written straight into the tier's device slots (as a
// finished collective leaves them), and after each update the trainer reads the parameters by
// a copy queued on the stream. `wait`: the host waits for the stream after each update.
Reads staged_updates(bool wait) {
  cpu::Arena arena(1);
  const std::unique_ptr<Compute> dev = make_async_cpu_compute(arena, 9, 2000);
  const std::unique_ptr<Compute> host = make_cpu_compute(arena);
  TwoUnits m(*dev);
  const TierContext& ctx = m.ctx;
  StagedStateTier tier(
      ctx,
      std::make_unique<MemoryStateTier>(
          ctx, Tier::host, *host, arena,
          std::vector<std::optional<float*>>{std::nullopt, std::nullopt}, false, Speculative::off),
      *dev, true);
  std::vector<Buffer> params;  // the parameter shards on the device
  for (int u = 0; u < 2; ++u) {
    tier.load_initial(u, random_floats(size_t(ctx.shard(u)), uint32_t(50 + u)).data());
    params.push_back(ctx.buffer(Tier::device, MemKind::buffer, "p", size_t(ctx.shard(u)) * 2, 0));
  }
  tier.finish_load();
  struct Sink final : ParamSink {
    std::vector<Buffer>& p;
    explicit Sink(std::vector<Buffer>& params) : p(params) {}
    void* target(int u) override { return p[size_t(u)].data(); }
    void done(int) override {}
    void restore(int, const float*) override {}
  } sink(params);
  cpu::UpdateHyper h;
  h.lr = 1e-2f, h.beta1 = 0.9f, h.beta2 = 0.999f, h.eps = 1e-8f;
  Reads reads(3, std::vector<std::vector<uint16_t>>(2));
  for (int step = 1; step <= 3; ++step) {
    for (int u = 0; u < 2; ++u) {
      const std::vector<float> g = random_floats(size_t(ctx.shard(u)), uint32_t(step * 10 + u));
      uint16_t* slot = static_cast<uint16_t*>(tier.grad_target(u));
      for (size_t i = 0; i < g.size(); ++i) slot[i] = uint16_t(std::bit_cast<uint32_t>(g[i]) >> 16);
      tier.grad_reduced(u, 0, nullptr);
    }
    EXPECT_FALSE(tier.settle_grads().has_value());
    h.bias_correction1 = 1 - std::pow(h.beta1, float(step));
    h.bias_correction2 = 1 - std::pow(h.beta2, float(step));
    tier.update({h}, step, sink);
    for (int u = 0; u < 2; ++u) {
      std::vector<uint16_t>& r = reads[size_t(step - 1)][size_t(u)];
      r.resize(size_t(ctx.shard(u)));
      dev->copy(r.data(), params[size_t(u)].data(), r.size() * 2);
    }
    if (wait) dev->synchronize();
  }
  dev->synchronize();
  return reads;
}

// A state tier's own contract, whatever the engine waits for around it: update() may be called
// as soon as the gradients are down, and the last update's uploads, which read the upload
// buffers on the stream, must have read them before this update rewrites them.
TEST(AsyncDevice, StagedStateTierUpdateWaitsForTheUploadsItOverwrites) {
  const Reads want = staged_updates(true), got = staged_updates(false);
  for (size_t step = 0; step < want.size(); ++step)
    for (size_t u = 0; u < 2; ++u)
      EXPECT_TRUE(got[step][u] == want[step][u]) << "update " << step + 1 << ", unit " << u;
}

// How the trainer passes gradients and reads parameters.
enum class Trainer {
  host,     // writes into grads()'s views and reads params() on the host
  hand_in,  // as host, but passes its own gradient arrays of the first unit to grads_ready(u,
            // grads) before the second unit's (so its reduction waits for its turn) and
            // overwrites them with NaN as soon as the call returns: it may reuse its memory then
  streams,  // on streams of its own (set_stream()), as torch on a GPU: writes each gradient by
            // work queued there and reads the new parameters by work queued after step(), with
            // no host wait between; steps 0-1 on one stream, the rest on a second
};

// Two units, trained for four steps on a one-rank engine: the parameters as the trainer reads
// them after every step.
Trained train(Config cfg, Trainer trainer = Trainer::host) {
  // They outlive the engine, as CUDA's must.
  AsyncTrainerStream first(101, 2000), second(202, 2000), third(303, 2000);
  Trained t;
  std::vector<std::shared_ptr<std::vector<float>>> reads;  // filled by the trainer's streams
  {
    Engine e(cfg, make_self_communicator());
    const std::vector<float> w0 = random_floats(1000, 11), w1 = random_floats(37, 12);
    const std::vector<float> w2 = random_floats(4099, 13), w3 = random_floats(515, 14);
    std::vector<Param> ps = {{"w0", {1000}, 0, {const_cast<float*>(w0.data()), 1000, DType::f32}},
                             {"w1", {37}, 0, {const_cast<float*>(w1.data()), 37, DType::f32}},
                             {"w2", {4099}, 0, {const_cast<float*>(w2.data()), 4099, DType::f32}}};
    const UnitId layer = e.add_unit("layer", ps);
    const UnitId head =
        e.add_unit("head", {{"w3", {515}, 0, {const_cast<float*>(w3.data()), 515, DType::f32}}});
    e.finalize();
    // The gradient of parameter i of a unit at a step: the same numbers whichever way they go in.
    const auto grad_of = [](int step, size_t i, int64_t n) {
      return random_floats(size_t(n), uint32_t(100 + step * 7 + i));
    };
    for (int step = 0; step < 4; ++step) {
      AsyncTrainerStream& ts = step < 2 ? first : second;
      const bool on_stream = trainer == Trainer::streams;
      if (on_stream) e.set_stream(ts.handle());
      // hand_in: the first unit first, so its reduction waits for the head's.
      if (trainer == Trainer::hand_in) {
        std::vector<std::vector<float>> mine;
        std::vector<TensorView> views;
        for (size_t i = 0; i < ps.size(); ++i) {
          mine.push_back(grad_of(step, i, shape_numel(ps[i].shape)));
          views.push_back({mine.back().data(), int64_t(mine.back().size()), DType::f32});
        }
        e.grads_ready(layer, views);
        for (auto& v : mine) std::fill(v.begin(), v.end(), NAN);
      }
      for (UnitId u : {head, layer}) {
        if (trainer == Trainer::hand_in && u == layer) continue;
        std::vector<TensorView> g = e.grads(u);
        for (size_t i = 0; i < g.size(); ++i) {
          std::vector<float> v = grad_of(step, u == head ? 3 : i, g[i].numel);
          if (on_stream)
            ts.issue(
                [to = g[i].data, v = std::move(v)] { std::memcpy(to, v.data(), v.size() * 4); });
          else
            std::memcpy(g[i].data, v.data(), v.size() * 4);
        }
        e.grads_ready(u);
      }
      e.step();
      auto read = std::make_shared<std::vector<float>>();
      reads.push_back(read);
      for (UnitId u : {layer, head})
        for (const TensorView& p : e.params(u)) {
          auto append = [read, p] {
            const float* f = static_cast<const float*>(p.data);
            read->insert(read->end(), f, f + p.numel);
          };
          if (on_stream)
            ts.issue(append);
          else
            append();
        }
      e.zero_grad();
    }
    // Full-state access (DeepSpeed's safe_get_full_fp32_param) goes through the device where
    // the communicator is NCCL's: on a stream the trainer just moved to, too.
    if (trainer == Trainer::streams) e.set_stream(third.handle());
    for (UnitId u : {layer, head})
      for (int p = 0; p < int(e.unit_params(u).size()); ++p) {
        const std::vector<float> f = e.read_full(u, p, StateKind::master);
        t.full.insert(t.full.end(), f.begin(), f.end());
      }
    t.memory = e.memory();
  }
  first.synchronize();
  second.synchronize();
  third.synchronize();
  for (const auto& r : reads) t.params.insert(t.params.end(), r->begin(), r->end());
  return t;
}

bool has_buffer(const MemoryReport& m, const std::string& name) {
  for (const NamedBuffer& b : m.buffers)
    if (b.name == name && b.peak > 0) return true;
  return false;
}

class AsyncComms : public ::testing::TestWithParam<const char*> {};

TEST_P(AsyncComms, EngineTakesTheGpuPathsAndTrainsBitwiseTheSame) {
  EnvVar config_decides("ZEROSHARD_ASYNC_DEVICE", "");
  EnvVar late("ZEROSHARD_ASYNC_JITTER_US", "2000");  // work late enough to lose any race
  EnvVar comm("ZEROSHARD_ASYNC_COMM", GetParam());   // collectives as NCCL's, or staged
  // Stage 0 updates the whole parameters in device memory, which the trainer reads right after
  // step(); stage 2 all-gathers them; the host tier updates on the CPU and copies them up.
  for (auto [stage, tier] :
       {std::pair{0, Tier::device}, std::pair{2, Tier::device}, std::pair{2, Tier::host}}) {
    Config cfg;
    cfg.stage = stage;
    cfg.optimizer.lr = 1e-2f;
    cfg.gradient_clipping = 1.0;
    cfg.offload_optimizer.tier = tier;
    const Trained ref = train(cfg);
    cfg.async_device = true;
    const Trained got = train(cfg);
    ASSERT_EQ(ref.params.size(), got.params.size());
    EXPECT_TRUE(same_bits(ref.params.data(), got.params.data(), ref.params.size() * 4))
        << "stage " << stage << ", " << tier_name(tier);
    // The trainer's own gradient arrays, reused at once: grads_ready() must have copied them.
    const Trained handed = train(cfg, Trainer::hand_in);
    EXPECT_TRUE(same_bits(ref.params.data(), handed.params.data(), ref.params.size() * 4))
        << "stage " << stage << ", " << tier_name(tier);
    // The host tier on a GPU stages gradient shards on the device: the async device does too.
    // A trainer on streams of its own, as torch on a GPU: the engine's work and the trainer's
    // are ordered by the streams alone, and a stream change (set_stream()) waits for the last.
    const Trained streamed = train(cfg, Trainer::streams);
    EXPECT_TRUE(same_bits(ref.params.data(), streamed.params.data(), ref.params.size() * 4))
        << "stage " << stage << ", " << tier_name(tier) << ", on the trainer's streams";
    ASSERT_EQ(ref.full.size(), 1000u + 37 + 4099 + 515);
    for (const Trained* t : {&got, &handed, &streamed})
      EXPECT_TRUE(t->full == ref.full) << "stage " << stage << ", " << tier_name(tier);
    if (tier == Tier::host) {
      EXPECT_TRUE(has_buffer(got.memory, "grad_shard_staging")) << got.memory.to_string();
      EXPECT_FALSE(has_buffer(ref.memory, "grad_shard_staging")) << ref.memory.to_string();
    }
  }
}

INSTANTIATE_TEST_SUITE_P(AsyncDevice, AsyncComms, ::testing::Values("nccl", "staged"));

// Two engines on one NCCL communicator (a GAN's two models, say): each one's collectives follow
// its own stream, whichever engine called one last. Read here by the full-state access, which
// copies the shards up on the engine's stream and gathers them on the shared communicator.
TEST(AsyncDevice, EnginesSharingTheCommunicatorFollowTheirOwnStreams) {
  EnvVar config_decides("ZEROSHARD_ASYNC_DEVICE", "");
  EnvVar late("ZEROSHARD_ASYNC_JITTER_US", "2000");
  EnvVar comm("ZEROSHARD_ASYNC_COMM", "nccl");
  Config cfg;
  cfg.stage = 2;
  cfg.async_device = true;
  Engine a(cfg, make_self_communicator());
  Engine b(cfg, a.communicator());  // NCCL's, as the first engine made it
  std::vector<std::vector<float>> init;
  for (Engine* e : {&a, &b}) {
    init.push_back(random_floats(5000, uint32_t(init.size() + 70)));
    e->add_unit("u", {{"w", {5000}, 0, {init.back().data(), 5000, DType::f32}}});
    e->finalize();
  }
  for (int round = 0; round < 6; ++round)
    for (int k = 0; k < 2; ++k) {
      Engine& e = k ? a : b;  // b, then a: a's gather comes right after b's
      EXPECT_TRUE(e.read_full(0, 0, StateKind::master) == init[size_t(k ? 0 : 1)])
          << "round " << round << (k ? ", first engine" : ", second engine");
    }
}

// Three units of 4096 trained for `steps` steps, clipped (every speculation dropped) in the steps
// below `clipped_until`: each step's StepResult.
std::vector<StepResult> train_three_units(const Config& cfg, int steps, int clipped_until = 0) {
  std::vector<StepResult> out;
  Engine e(cfg, make_self_communicator());
  for (int u = 0; u < 3; ++u) e.add_unit("u" + std::to_string(u), {Param{"w", {4096}}});
  e.finalize();
  for (int step = 0; step < steps; ++step) {
    for (int u = 2; u >= 0; --u) {
      std::vector<TensorView> g = e.grads(u);
      std::vector<float> v = random_floats(size_t(g[0].numel), uint32_t(step * 3 + u));
      std::memcpy(g[0].data, v.data(), v.size() * 4);
      e.grads_ready(u);
    }
    if (step < clipped_until) e.clip_grad_norm(1e-9);
    out.push_back(e.step());
  }
  return out;
}

// speculative_step left to the engine ("auto"): a GPU engine (here the asynchronous device
// playing one) takes it with the optimizer state on nvme, and says so; with the state on the
// host tier it leaves it off, saying why (a second copy of the state); a CPU engine, whose
// backward runs on the cores the update would use, leaves it off and says nothing.
TEST(AsyncDevice, AutomaticSpeculationTakesTheNvmeTierOnAGpu) {
  const std::filesystem::path swap = std::filesystem::temp_directory_path() /
                                     ("zeroshard-auto-spec-" + std::to_string(::getpid()));
  std::filesystem::create_directories(swap);
  for (bool gpu : {true, false})
    for (Tier tier : {Tier::nvme, Tier::host}) {
      const std::string what = std::string(gpu ? "async " : "cpu ") + tier_name(tier);
      Config cfg;
      cfg.stage = 2;
      cfg.async_device = gpu;
      cfg.gradient_clipping = 0;
      cfg.offload_optimizer.tier = tier;
      if (tier == Tier::nvme) cfg.offload_optimizer.nvme_paths = {swap.string()};
      EXPECT_EQ(cfg.speculative_step, SpeculativeStep::automatic);
      EnvVar env("ZEROSHARD_ASYNC_DEVICE", gpu ? "1" : "0");
      ::testing::internal::CaptureStderr();
      int speculated = 0;
      for (const StepResult& r : train_three_units(cfg, 2))
        speculated += r.speculation_kept + r.speculation_dropped;
      const std::string said = ::testing::internal::GetCapturedStderr();
      const bool takes = gpu && tier == Tier::nvme;
      EXPECT_EQ(speculated, takes ? 6 : 0) << what;
      if (takes)
        EXPECT_NE(said.find("speculative_step (auto) is on"), std::string::npos) << what << said;
      else if (gpu)
        EXPECT_NE(said.find("auto leaves it off on the host tier"), std::string::npos)
            << what << said;
      else
        EXPECT_EQ(said.find("speculative_step"), std::string::npos) << what << said;
    }
  std::filesystem::remove_all(swap);
}

// Left to the engine, speculation pauses where it keeps nothing: after a step whose
// speculations were all dropped (here: clipped), the engine speculates no more for 1, then 2,
// then 4 steps while that repeats, and resets once a step keeps them. Asked for, it speculates
// every step. Either way each step is the step without speculation (test_speculation.cpp).
TEST(AsyncDevice, AutomaticSpeculationPausesWhileStepsKeepNothing) {
  const std::filesystem::path swap = std::filesystem::temp_directory_path() /
                                     ("zeroshard-spec-pause-" + std::to_string(::getpid()));
  std::filesystem::create_directories(swap);
  EnvVar env("ZEROSHARD_ASYNC_DEVICE", "1");
  for (SpeculativeStep mode : {SpeculativeStep::automatic, SpeculativeStep::on}) {
    Config cfg;
    cfg.stage = 2;
    cfg.async_device = true;
    cfg.offload_optimizer.tier = Tier::nvme;
    cfg.offload_optimizer.nvme_paths = {swap.string()};
    cfg.speculative_step = mode;
    // A gradient cache that holds every unit: backward never evicts a gradient whose
    // speculation has not started (which drops it, on a loaded machine), so which steps keep
    // is the clipping's alone.
    cfg.grad_buffers = 3;
    std::vector<int> speculated;  // the steps that speculated
    const std::vector<StepResult> steps = train_three_units(cfg, 12, 6);
    for (int step = 0; step < 12; ++step) {
      const StepResult& r = steps[size_t(step)];
      EXPECT_EQ(r.speculation_kept, step < 6 ? 0 : r.speculation_kept + r.speculation_dropped);
      if (r.speculation_kept + r.speculation_dropped > 0) speculated.push_back(step);
    }
    if (mode == SpeculativeStep::on)
      EXPECT_EQ(speculated, std::vector<int>({0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11}));
    else  // paused after steps 0, 2 and 5 for 1, 2 and 4 steps; kept again from step 10
      EXPECT_EQ(speculated, std::vector<int>({0, 2, 5, 10, 11}));
  }
  std::filesystem::remove_all(swap);
}

TEST(AsyncDevice, SelectedByConfigOrEnvironmentAndTakesWhatAGpuTakes) {
  cpu::Arena arena(1);
  Config cfg;
  cfg.stage = 1;
  {
    EnvVar off("ZEROSHARD_ASYNC_DEVICE", "0");
    cfg.async_device = true;
    EXPECT_FALSE(async_device_selected(cfg));  // the environment overrides the config
    EXPECT_FALSE(make_compute(cfg, arena)->streams());
  }
  {
    EnvVar on("ZEROSHARD_ASYNC_DEVICE", "1");
    cfg.async_device = false;
    EXPECT_TRUE(async_device_selected(cfg));
    EXPECT_TRUE(make_compute(cfg, arena)->streams());
    // Stage 0 with the optimizer on the host is what a GPU refuses: it stays synchronous.
    Config s0 = cfg;
    s0.stage = 0;
    s0.offload_optimizer.tier = Tier::host;
    EXPECT_FALSE(async_device_selected(s0));
  }
  {
    EnvVar bad("ZEROSHARD_ASYNC_DEVICE", "yes");
    EXPECT_THROW(async_device_selected(cfg), Error);
  }
  {
    EnvVar on("ZEROSHARD_ASYNC_DEVICE", "1");
    EnvVar bad("ZEROSHARD_ASYNC_COMM", "mpi");
    EXPECT_THROW(make_compute(cfg, arena), Error);
  }
  // Asked for in the config, a configuration a GPU refuses is refused by name.
  Config s0;
  s0.stage = 0;
  s0.async_device = true;
  s0.offload_optimizer.tier = Tier::host;
  try {
    s0.validate();
    FAIL() << "stage 0 with the host tier validated on the async device";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("zeroshard.async_device = true"), std::string::npos)
        << e.what();
  }
  Config both;
  both.device = Device::cuda;
  both.async_device = true;
  EXPECT_THROW(both.validate(), Error);
}

}  // namespace
}  // namespace zeroshard
