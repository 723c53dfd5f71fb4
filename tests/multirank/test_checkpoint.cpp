// Checkpoints: save at this world size and stage, load at another stage on the same ranks and
// at world size 1 (rank 0 alone), and continue exactly as the original; every kind of damage
// to every kind of file fails the load on every rank (test_checkpoint_safety.cpp).
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>

#include "src/checkpoint/format.hpp"
#include "tests/multirank/harness.hpp"
#include "zeroshard/quantize.hpp"

using namespace zeroshard;
using zs_test::shared_dir;
using zs_test::world;

namespace {

Config cfg_for(int stage, StateFormat moments = StateFormat::f32) {
  Config c;
  c.stage = stage;
  c.optimizer_state = moments;
  c.state_block = 64;
  c.dtype = DType::bf16;
  c.optimizer.lr = 1e-2f;
  c.shard_alignment = 4;
  return c;
}

// Gathers a unit's whole f32 state over the ranks (for comparing across world sizes).
std::vector<float> whole(Engine& e, int u, StateKind k) {
  ShardInfo s = e.shard_info(u);
  std::vector<float> shard = e.read_shard(u, k), all(size_t(s.padded_numel));
  world()->all_gather(shard.data(), all.data(), s.shard_numel, DType::f32, "test gather")->wait();
  all.resize(size_t(s.numel));
  return all;
}

// Bytes a checkpoint's moment file holds for a range of n values, as encoding.hpp states it: f32
// 4 per value, bf16 2, 8-bit 1 plus one f32 absmax per block of 64 (cfg_for's state_block).
int64_t moment_bytes(StateFormat f, int64_t n) {
  return f == StateFormat::f32 ? 4 * n : f == StateFormat::bf16 ? 2 * n : n + 4 * ((n + 63) / 64);
}

// Each moment file of the checkpoint in `tag` holds its ranges in the run's format: no bigger.
void expect_compact_moments(const std::filesystem::path& tag, StateFormat f) {
  const ckpt::Manifest m = ckpt::read_manifest(tag);
  EXPECT_EQ(m.state_format, f);
  for (int r = 0; r < m.world_size; ++r) {
    int64_t data = 0, values = 0;
    for (const ckpt::Range& rg : m.ranges[size_t(r)]) {
      data += moment_bytes(f, rg.end - rg.begin);
      values += rg.end - rg.begin;
    }
    for (const char* s : {"state0", "state1"}) {
      const ckpt::FileHeader h{0, r, 0, m.block_bytes, data};
      EXPECT_EQ(int64_t(std::filesystem::file_size(tag / ckpt::data_file_name(r, s))),
                ckpt::file_bytes(h))
          << s << " of rank " << r;
    }
    const ckpt::FileHeader master{0, r, 0, m.block_bytes, 4 * values};
    EXPECT_EQ(int64_t(std::filesystem::file_size(tag / ckpt::data_file_name(r, "master"))),
              ckpt::file_bytes(master));
  }
}

// Every moment format: bf16 and 8-bit moments are saved as they are kept, and load back to the
// same bits at any world size (8-bit: the same codes and absmax, a shard starting on a block
// boundary at every world size).
TEST(Checkpoint, LoadsAtAnotherStageAndWorldSize) {
  for (StateFormat f : {StateFormat::f32, StateFormat::bf16, StateFormat::q8}) {
    SCOPED_TRACE(state_format_name(f));
    auto dir = shared_dir(std::string("ckpt-a") + state_format_name(f));
    Engine a(cfg_for(3, f), world());
    zs_test::register_model(a, zs_test::uneven_model());
    zs_test::TrainOptions o;
    o.steps = 4;
    zs_test::train(a, o);
    EXPECT_EQ(a.save(dir), dir / "step00000004");
    ASSERT_TRUE(std::filesystem::exists(dir / "step00000004" / "manifest.json"));
    ASSERT_TRUE(std::filesystem::exists(dir / "latest"));
    if (world()->rank() == 0) expect_compact_moments(dir / "step00000004", f);

    // Same ranks, stage 1: continues bitwise like the original.
    Engine b(cfg_for(1, f), world());
    zs_test::register_model(b, zs_test::uneven_model());
    b.load(dir);
    EXPECT_EQ(b.step_count(), a.step_count());
    zs_test::train(a, o);
    zs_test::train(b, o);
    for (int u = 0; u < a.num_units(); ++u)
      for (StateKind k :
           {StateKind::param, StateKind::master, StateKind::state0, StateKind::state1}) {
        auto x = a.read_shard(u, k), y = b.read_shard(u, k);
        EXPECT_EQ(std::memcmp(x.data(), y.data(), x.size() * 4), 0) << "unit " << u;
      }

    // World size 1 (rank 0 alone, stage 0) reads every range back: the states equal the gathered
    // ones of the 4-step checkpoint, whatever world size wrote it.
    Engine c(cfg_for(3, f), world());
    zs_test::register_model(c, zs_test::uneven_model());
    c.load(dir);
    std::vector<std::vector<float>> ref;
    for (int u = 0; u < c.num_units(); ++u) ref.push_back(whole(c, u, StateKind::state1));
    if (world()->rank() == 0) {
      Engine solo(cfg_for(0, f), make_self_communicator());
      zs_test::register_model(solo, zs_test::uneven_model());
      solo.load(dir);
      for (int u = 0; u < solo.num_units(); ++u) {
        auto v = solo.read_shard(u, StateKind::state1);
        v.resize(ref[size_t(u)].size());
        EXPECT_EQ(std::memcmp(v.data(), ref[size_t(u)].data(), v.size() * 4), 0) << "unit " << u;
      }
    }
    world()->barrier("checkpoint test");
    if (world()->rank() == 0) std::filesystem::remove_all(dir);
  }
}

// A run may change its moments' format at a resume: a load narrows what the checkpoint holds
// into the engine's format (f32 → 8-bit quantizes, in the loading engine's blocks) and widens
// back (8-bit → f32 gives code × absmax exactly). Whole units, since the two formats pad shards
// to different grains.
TEST(Checkpoint, LoadsIntoAnotherMomentFormat) {
  auto dir = shared_dir("ckpt-formats");
  Engine wide(cfg_for(3, StateFormat::f32), world()), narrow(cfg_for(3, StateFormat::q8), world());
  for (Engine* e : {&wide, &narrow}) {
    zs_test::register_model(*e, zs_test::uneven_model());
    zs_test::TrainOptions o;
    o.steps = 3;
    zs_test::train(*e, o);
  }
  wide.save(dir, "f32");
  narrow.save(dir, "q8");

  Engine q(cfg_for(2, StateFormat::q8), world()), f(cfg_for(2, StateFormat::f32), world());
  for (Engine* e : {&q, &f}) zs_test::register_model(*e, zs_test::uneven_model());
  q.load(dir / "f32");
  f.load(dir / "q8");
  bool changed = false;
  for (int u = 0; u < wide.num_units(); ++u)
    for (StateKind k : {StateKind::state0, StateKind::state1}) {
      const bool is_signed = k == StateKind::state0;
      const std::vector<float> x = whole(wide, u, k);
      const int64_t n = int64_t(x.size());
      std::vector<uint8_t> codes(x.size());
      std::vector<float> absmax(size_t((n + 63) / 64)), want(x.size());
      quantize_8bit(x.data(), n, 64, is_signed, codes.data(), absmax.data());
      dequantize_8bit(codes.data(), absmax.data(), n, 64, is_signed, want.data());
      const std::vector<float> got_q = whole(q, u, k), y = whole(narrow, u, k),
                               got_f = whole(f, u, k);
      EXPECT_EQ(std::memcmp(got_q.data(), want.data(), size_t(n) * 4), 0)
          << "f32 -> 8bit, unit " << u;
      EXPECT_EQ(std::memcmp(got_f.data(), y.data(), size_t(n) * 4), 0) << "8bit -> f32, unit " << u;
      changed |= std::memcmp(want.data(), x.data(), size_t(n) * 4) != 0;
    }
  EXPECT_TRUE(changed) << "quantizing changed no unit: the test shows nothing";
  world()->barrier("checkpoint formats test");
  if (world()->rank() == 0) std::filesystem::remove_all(dir);
}

// An f16 run's loss scaler goes on from a checkpoint exactly: its counters (overflows still
// tolerated, iterations since the last overflow) come back with the scale, so the resumed run
// halves and doubles the scale at the same steps as the uninterrupted one.
TEST(Checkpoint, RestoresTheLossScalersCounters) {
  auto dir = shared_dir("ckpt-scaler");
  Config cfg = cfg_for(2);
  cfg.dtype = DType::f16;
  cfg.loss_scale.initial_scale_power = 8;  // 2^16 would overflow f16 on the clean steps too
  cfg.loss_scale.hysteresis = 3;
  cfg.loss_scale.window = 5;
  Engine a(cfg, world());
  zs_test::register_model(a, zs_test::uneven_model());
  zs_test::TrainOptions bad, clean;
  bad.steps = 1;
  clean.steps = 2;
  bad.tamper = [](Engine&, int u, int, int64_t, std::vector<TensorView>& g) {
    if (u == 0) zs_test::store(g[0].data, g[0].dtype, 0, std::numeric_limits<float>::infinity());
  };
  zs_test::train(a, bad);  // one of three tolerated overflows used
  zs_test::train(a, clean);
  const LossScalerState saved = a.loss_scaler_state();
  EXPECT_EQ(saved.hysteresis_left, 2);
  EXPECT_EQ(saved.iteration, 3);
  a.save(dir);
  Engine b(cfg, world());
  zs_test::register_model(b, zs_test::uneven_model());
  b.load(dir);
  const LossScalerState got = b.loss_scaler_state();
  EXPECT_EQ(got.scale, saved.scale);
  EXPECT_EQ(got.hysteresis_left, saved.hysteresis_left);
  EXPECT_EQ(got.iteration, saved.iteration);
  EXPECT_EQ(got.last_overflow, saved.last_overflow);
  world()->barrier("checkpoint test scaler");
  if (world()->rank() == 0) std::filesystem::remove_all(dir);
}

}  // namespace
