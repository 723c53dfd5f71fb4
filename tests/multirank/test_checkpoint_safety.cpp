// Checkpoints that never lose a run: bitwise resume on every stage and tier (with the learning
// rate, every hyperparameter and the step), tags that are never overwritten and are pruned by
// keep_last, a load that drops stale stage-3 prefetches, and damage of every kind to every kind
// of file (data blocks, headers, checksum tables, manifests, `latest`, files of another save or
// model): each fails the load on every rank with the file named, and leaves the engine as it was
// or, where a damaged block is found as the load reads it, refusing to train until a load
// succeeds.
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "src/checkpoint/format.hpp"
#include "src/checkpoint/safetensors.hpp"
#include "tests/multirank/harness.hpp"
#include "zeroshard/checkpoint.hpp"
#include "zeroshard/planner.hpp"

using namespace zeroshard;
using zs_test::shared_dir;
using zs_test::world;
namespace fs = std::filesystem;

namespace {

Config cfg_for(int stage, Tier tier = Tier::device, StateFormat moments = StateFormat::f32) {
  Config c;
  c.stage = stage;
  c.optimizer_state = moments;
  c.state_block = 64;
  c.dtype = DType::bf16;
  c.optimizer.lr = 1e-2f;
  c.shard_alignment = 4;
  c.offload_optimizer.tier = tier;
  if (tier == Tier::nvme) {
    // Per rank; the engine removes its run directory in it.
    c.offload_optimizer.nvme_paths = {zs_test::process_dir("ckpt-swap").string()};
    c.aio.block_size = 4096;
  }
  return c;
}

void cleanup(const fs::path& p) {
  world()->barrier("checkpoint test end");
  if (world()->rank() == 0) fs::remove_all(p);
}

using Snapshot = std::vector<std::vector<float>>;
Snapshot snapshot(const Engine& e) {
  Snapshot s;
  for (int u = 0; u < e.num_units(); ++u)
    for (StateKind k : {StateKind::param, StateKind::master, StateKind::state0, StateKind::state1})
      if (k == StateKind::param || e.has_state(k)) s.push_back(e.read_shard(u, k));
  return s;
}
bool same(const Snapshot& a, const Snapshot& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i)
    if (a[i].size() != b[i].size() || std::memcmp(a[i].data(), b[i].data(), a[i].size() * 4))
      return false;
  return true;
}

std::string slurp(const fs::path& p) {
  std::ifstream is(p, std::ios::binary);
  std::stringstream ss;
  ss << is.rdbuf();
  return ss.str();
}
void spill(const fs::path& p, const std::string& s) {
  std::ofstream(p, std::ios::binary | std::ios::trunc) << s;
}
void flip_byte(const fs::path& p, int64_t offset) {
  std::string s = slurp(p);
  s[size_t(offset)] = char(s[size_t(offset)] ^ 0x10);
  spill(p, s);
}

// Engines trained a few steps, with group 0's hyperparameters changed as a scheduler would.
void train_some(Engine& e, int steps) {
  zs_test::TrainOptions o;
  o.steps = steps;
  zs_test::train(e, o);
}

}  // namespace

// Save, train on; a new engine loads and trains on: every state bitwise the same, and the step,
// learning rate and other hyperparameters of every group came back from the checkpoint.
TEST(CheckpointResume, BitwiseOnEveryStageAndTier) {
  const fs::path dir = shared_dir("ckpt-resume");
  int n = 0;
  for (int stage : {0, 1, 2, 3})
    for (Tier tier : {Tier::device, Tier::host, Tier::nvme}) {
      if (stage == 0 && tier != Tier::device) continue;  // offload needs a stage >= 1
      OptimizerOptions no_decay = cfg_for(stage).optimizer;
      no_decay.weight_decay = 0;
      Engine a(cfg_for(stage, tier), world());
      a.add_group(no_decay);
      zs_test::register_model(a, zs_test::uneven_model(), 1);
      train_some(a, 3);
      OptimizerOptions g0 = a.options(0), g1 = a.options(1);
      g0.lr = 3e-3f, g0.beta1 = 0.85f, g1.weight_decay = 0.2f;
      a.set_options(0, g0);
      a.set_options(1, g1);
      const std::string tag = "t" + std::to_string(n++);
      a.save(dir, tag);
      Engine b(cfg_for(stage == 3 ? 1 : 3, tier), world());  // another stage as well
      b.add_group(no_decay);
      zs_test::register_model(b, zs_test::uneven_model(), 1);
      b.load(dir);  // the root: follows latest
      EXPECT_EQ(b.step_count(), 3);
      EXPECT_EQ(b.options(0).lr, 3e-3f);
      EXPECT_EQ(b.options(0).beta1, 0.85f);
      EXPECT_EQ(b.options(1).weight_decay, 0.2f);
      train_some(a, 2);
      train_some(b, 2);
      EXPECT_TRUE(same(snapshot(a), snapshot(b)))
          << "stage " << stage << " tier " << tier_name(tier);
    }
  cleanup(dir);
}

// A load writes the state where it lies: the engine's memory is what it was before the load
// (peaks included where the state is in memory: it is written in place, with no copy held), and
// the state is the checkpoint's, at every stage (stage 0 keeps the whole state, gathered after
// the load) and with the state in host memory or on the nvme tier (through its records).
TEST(CheckpointResume, LoadTakesNoMemoryOfItsOwn) {
  const fs::path dir = shared_dir("ckpt-in-place");
  for (int stage : {0, 1, 3})
    for (Tier tier : {Tier::host, Tier::nvme}) {
      if (stage == 0 && tier == Tier::nvme) continue;  // offload needs a stage >= 1
      const Tier t = stage == 0 ? Tier::device : tier;
      const std::string what = "stage " + std::to_string(stage) + ", " + tier_name(t) + " tier";
      Engine a(cfg_for(stage, t), world()), b(cfg_for(stage, t), world());
      zs_test::register_model(a, zs_test::uneven_model());
      zs_test::register_model(b, zs_test::uneven_model());
      train_some(a, 3);
      train_some(b, 1);
      a.save(dir, "s" + std::to_string(stage) + tier_name(t));
      const MemoryReport held = b.memory();
      b.load(dir);
      const MemoryReport after = b.memory();
      EXPECT_EQ(after.bytes, held.bytes) << what;
      if (t != Tier::nvme) {  // the nvme tier's write() stages through buffers of its own
        EXPECT_EQ(after.peak, held.peak) << what;
      }
      EXPECT_TRUE(same(snapshot(a), snapshot(b))) << what;
      train_some(a, 1);
      train_some(b, 1);
      EXPECT_TRUE(same(snapshot(a), snapshot(b))) << what << ", a step later";
    }
  cleanup(dir);
}

// A tag is never overwritten; keep_last prunes the oldest; a name that is no plain directory
// name is refused; inspect and verify read a checkpoint without an engine.
TEST(CheckpointTags, NeverOverwrittenAndPrunedByKeepLast) {
  const fs::path dir = shared_dir("ckpt-tags");
  Config c = cfg_for(2);
  c.checkpoint_keep_last = 2;
  Engine e(c, world());
  zs_test::register_model(e, zs_test::uneven_model());
  for (int i = 0; i < 3; ++i) {
    train_some(e, 1);
    e.save(dir);
  }
  // Rank 0 prunes after the save's agreement (a slow removal must not hold the others in a
  // timed collective): wait for it.
  world()->barrier("pruned");
  EXPECT_FALSE(fs::exists(dir / "step00000001")) << "keep_last = 2 keeps the newest two";
  EXPECT_TRUE(fs::exists(dir / "step00000002"));
  EXPECT_TRUE(fs::exists(dir / "step00000003"));
  EXPECT_EQ(slurp(dir / "latest"), "step00000003\n");
  const Snapshot before = snapshot(e);
  EXPECT_THROW(e.save(dir), Error) << "step00000003 exists";
  EXPECT_THROW(e.save(dir, "../escape"), Error);
  EXPECT_THROW(e.save(dir, ".hidden"), Error);
  EXPECT_THROW(e.save(dir, "latest.tmp"), Error) << "would collide with latest's update";
  EXPECT_THROW(e.save(dir, "a\nb"), Error) << "latest would name another tag";
  EXPECT_TRUE(same(before, snapshot(e)));
  if (world()->rank() == 0) {
    const std::string table = describe_checkpoint(dir);
    EXPECT_NE(table.find("step         3"), std::string::npos) << table;
    EXPECT_NE(table.find("layer1"), std::string::npos) << table;
    int64_t last = 0;
    EXPECT_GT(verify_checkpoint(dir, [&](int64_t done, int64_t) { last = done; }), 0);
    EXPECT_GT(last, 0);
  }
  cleanup(dir);
}

// Stage 3 prefetches the next unit of the recorded order while the trainer holds this one:
// after a load, a gather must see the loaded parameters, not the prefetched old ones.
TEST(CheckpointResume, LoadDropsStage3Prefetches) {
  const fs::path dir = shared_dir("ckpt-prefetch");
  Engine a(cfg_for(3), world()), b(cfg_for(3), world());
  zs_test::register_model(a, zs_test::uneven_model());
  zs_test::register_model(b, zs_test::uneven_model());
  train_some(a, 3);
  a.save(dir);
  train_some(b, 1);  // records the gather order
  b.gather(0);       // prefetches unit 1 with b's values
  b.release(0);
  b.load(dir);
  for (int u = 0; u < a.num_units(); ++u) {
    std::vector<TensorView> x = a.gather(u), y = b.gather(u);
    for (size_t i = 0; i < x.size(); ++i)
      EXPECT_EQ(std::memcmp(x[i].data, y[i].data, x[i].bytes()), 0) << "unit " << u;
    a.release(u);
    b.release(u);
  }
  cleanup(dir);
}

namespace {

// Where a load finds the damage: before any state changes (manifests, pointers, a data file's
// header or checksum table), or only as the block is read.
enum class Found { before_writing, while_reading };

// A fresh checkpoint of engine `a` in dir/<tag>, damaged by rank 0's `damage(tag_dir)`; then a
// load into `b` must fail on every rank with `code` and `text`, its memory as before. Damage found
// before writing leaves b unchanged. Damage found while reading leaves b holding no valid state:
// step(), gather() and save() refuse on every rank, naming the load, until a load of an intact
// checkpoint brings b to a's state. With f32 state in host memory a load reads the blocks
// straight to where the state lies, else through UnitReader, decoding 8-bit moments (load.cpp):
// each is damaged.
void expect_refused(const std::string& name, const std::function<void(const fs::path&)>& damage,
                    ErrorCode code, const std::string& text, Found found = Found::before_writing) {
  const std::pair<Tier, StateFormat> runs[] = {{Tier::host, StateFormat::f32},
                                               {Tier::nvme, StateFormat::f32},
                                               {Tier::nvme, StateFormat::q8}};
  for (auto [tier, f] : runs) {
    const std::string what =
        name + " (" + tier_name(tier) + " tier, " + state_format_name(f) + " moments)";
    const fs::path dir = shared_dir("ckpt-damage");
    Engine a(cfg_for(2, tier, f), world()), b(cfg_for(2, tier, f), world());
    zs_test::register_model(a, zs_test::uneven_model());
    zs_test::register_model(b, zs_test::uneven_model());
    train_some(a, 2);
    train_some(b, 1);
    const fs::path tag = a.save(dir);
    world()->barrier("saved");
    if (world()->rank() == 0) damage(tag);
    world()->barrier("damaged");
    const Snapshot before = snapshot(b);
    const MemoryReport held = b.memory();
    try {
      b.load(dir);
      ADD_FAILURE() << what << ": loaded a damaged checkpoint";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), code) << what << ": " << e.what();
      EXPECT_NE(std::string(e.what()).find(text), std::string::npos) << what << ": " << e.what();
    }
    EXPECT_EQ(b.memory().bytes, held.bytes) << what << ": a failed load kept memory";
    if (found == Found::before_writing) {
      EXPECT_TRUE(same(before, snapshot(b))) << what << ": a failed load changed the engine";
      EXPECT_EQ(b.step_count(), 1) << what;
    } else {
      const std::string refused = "holds no valid state: load(" + dir.string();
      EXPECT_ZS_ERROR(b.step(), invalid_argument, refused);
      EXPECT_ZS_ERROR(b.gather(0), invalid_argument, refused);
      EXPECT_ZS_ERROR(b.save(dir, "after"), invalid_argument, refused);
      EXPECT_ZS_ERROR(b.save_async(dir, "after"), invalid_argument, refused);
      a.save(dir, "intact");
      b.load(dir);
      EXPECT_TRUE(same(snapshot(a), snapshot(b))) << what << ": the load after a failed one";
      train_some(b, 1);
      EXPECT_EQ(b.step_count(), 3) << what;
    }
    cleanup(dir);
  }
}

const int64_t kData = ckpt::kHeaderBytes;  // first data byte of a data file

int64_t size_of(const fs::path& p) {
  return int64_t(fs::file_size(p));
}

std::string replace(std::string s, const std::string& from, const std::string& to) {
  const size_t at = s.find(from);
  EXPECT_NE(at, std::string::npos) << from;
  if (at != std::string::npos) s.replace(at, from.size(), to);
  return s;
}

}  // namespace

TEST(CheckpointDamage, DataFiles) {
  const int last = world()->size() - 1;
  const std::string f0 = "rank00000.master", fl = ckpt::data_file_name(last, "state1");
  expect_refused(
      "flipped bit", [&](const fs::path& t) { flip_byte(t / f0, kData + 5); }, ErrorCode::corrupted,
      "rank00000.master\": block 0", Found::while_reading);
  expect_refused(
      "zeroed block",
      [&](const fs::path& t) {
        std::string s = slurp(t / fl);
        const int64_t data = size_of(t / fl) - kData - 16;  // one block: its sum, the table's
        ASSERT_GT(data, 0) << "the last rank's file holds no data";
        std::memset(s.data() + kData, 0, size_t(data));
        spill(t / fl, s);
      },
      ErrorCode::corrupted, "fails its checksum", Found::while_reading);
  expect_refused(
      "truncated", [&](const fs::path& t) { fs::resize_file(t / f0, uintmax_t(kData + 8)); },
      ErrorCode::corrupted, "truncated");
  expect_refused(
      "header", [&](const fs::path& t) { flip_byte(t / fl, 20); }, ErrorCode::corrupted,
      "header checksum mismatch");
  expect_refused(
      "checksum table", [&](const fs::path& t) { flip_byte(t / f0, size_of(t / f0) - 3); },
      ErrorCode::corrupted, "checksum table is damaged");
  expect_refused(
      "missing", [&](const fs::path& t) { fs::remove(t / fl); }, ErrorCode::corrupted,
      "is missing");
  // A FIFO would block the open (and every read) forever.
  expect_refused(
      "a FIFO",
      [&](const fs::path& t) {
        fs::remove(t / fl);
        ASSERT_EQ(::mkfifo((t / fl).c_str(), 0644), 0);
      },
      ErrorCode::corrupted, "is not a regular file");
}

TEST(CheckpointDamage, ManifestsAndPointers) {
  auto edit = [](const std::string& from, const std::string& to) {
    return [=](const fs::path& t) {
      spill(t / "manifest.json", replace(slurp(t / "manifest.json"), from, to));
    };
  };
  expect_refused("changed value", edit("\"step\": 2", "\"step\": 3"), ErrorCode::corrupted,
                 "checksum mismatch");
  expect_refused("another schema", edit("\"schema\": 4", "\"schema\": 5"),
                 ErrorCode::invalid_argument, "has schema 5");
  expect_refused("wrong type", edit("\"step\": 2", "\"step\": \"2\""), ErrorCode::corrupted,
                 "step is not an integer");
  expect_refused("not JSON", edit("{", "["), ErrorCode::corrupted, "manifest.json");
  expect_refused(
      "latest outside the root",
      [](const fs::path& t) {
        fs::remove(t / "manifest.json");  // so the root's pointer is what load() follows
        spill(t.parent_path() / "latest", "../../etc\n");
      },
      ErrorCode::corrupted, "names no tag");
  // `latest` is read whole: a device would be read without end, a FIFO block, a long file be
  // pasted into the message.
  auto latest_is = [](std::function<void(const fs::path&)> make) {
    return [make](const fs::path& t) {
      fs::remove(t / "manifest.json");
      fs::remove(t.parent_path() / "latest");
      make(t.parent_path() / "latest");
    };
  };
  expect_refused("latest a device",
                 latest_is([](const fs::path& l) { fs::create_symlink("/dev/zero", l); }),
                 ErrorCode::corrupted, "is not a regular file");
  expect_refused("latest a FIFO",
                 latest_is([](const fs::path& l) { ASSERT_EQ(::mkfifo(l.c_str(), 0644), 0); }),
                 ErrorCode::corrupted, "is not a regular file");
  expect_refused("latest a directory",
                 latest_is([](const fs::path& l) { fs::create_directory(l); }),
                 ErrorCode::corrupted, "is not a regular file");
  expect_refused("latest too long",
                 latest_is([](const fs::path& l) { spill(l, std::string(5000, 'a') + "\n"); }),
                 ErrorCode::corrupted, "over the 256");
}

// DeepSpeed's loading choices: the weights alone (load_optimizer_states=False,
// load_module_only) keep the moments, the step count and the loss scaler; without the
// hyperparameters (load_lr_scheduler_states=False) the groups keep theirs. A root without
// `latest` is refused, naming the tags it holds.
TEST(CheckpointResume, LoadOptionsKeepWhatTheySay) {
  const fs::path dir = shared_dir("ckpt-options");
  Engine a(cfg_for(2), world()), b(cfg_for(2), world());
  zs_test::register_model(a, zs_test::uneven_model());
  zs_test::register_model(b, zs_test::uneven_model());
  train_some(a, 2);
  a.set_lr(0, 0.125f);
  train_some(b, 1);
  const fs::path tag = a.save(dir);
  const Snapshot sa = snapshot(a), sb = snapshot(b);
  LoadOptions weights;
  weights.optimizer_states = false;
  weights.hyperparameters = false;
  b.load(dir, weights);
  const Snapshot got = snapshot(b);  // per unit: parameters, master, m, v (AdamW)
  ASSERT_EQ(got.size(), sa.size());
  for (size_t i = 0; i < got.size(); ++i)
    EXPECT_TRUE(same({got[i]}, {i % 4 < 2 ? sa[i] : sb[i]}))
        << "entry " << i << (i % 4 < 2 ? ": the checkpoint's weights" : ": b's own moments");
  EXPECT_EQ(b.step_count(), 1);
  EXPECT_NE(b.options(0).lr, 0.125f);
  LoadOptions hyper;
  hyper.hyperparameters = true;
  hyper.optimizer_states = false;
  b.load(dir, hyper);
  EXPECT_EQ(b.options(0).lr, 0.125f);
  EXPECT_EQ(b.step_count(), 1);
  b.load(dir);
  EXPECT_TRUE(same(sa, snapshot(b)));
  EXPECT_EQ(b.step_count(), 2);
  world()->barrier("loaded");
  if (world()->rank() == 0) fs::remove(dir / "latest");
  world()->barrier("latest removed");
  EXPECT_ZS_ERROR(b.load(dir), invalid_argument,
                  "load one of the tags it holds by its directory: " + tag.filename().string());
  cleanup(dir);
}

// A manifest whose block size disagrees with its files' headers (rewritten with a valid
// checksum, as a tool that edits it would): the error names the field and both values.
TEST(CheckpointDamage, AManifestThatDisagreesWithAHeaderNamesTheField) {
  expect_refused(
      "block_bytes",
      [](const fs::path& t) {
        ckpt::Manifest m = ckpt::read_manifest(t);
        const int64_t was = m.block_bytes;
        m.block_bytes *= 2;
        spill(t / "manifest.json", ckpt::manifest_text(m));
        EXPECT_GT(was, 0);
      },
      ErrorCode::corrupted, "block_bytes ");
}

// A job killed after a tag was renamed into place and before `latest` named it leaves a
// complete tag no load reads. The restarted job resumes from the older tag, reaches the same
// step and saves that tag again: the unpublished one is replaced, and the run goes on; a
// published tag is still never overwritten.
TEST(CheckpointTags, ARestartReplacesATagThatWasNeverPublished) {
  const fs::path dir = shared_dir("ckpt-unpublished");
  Config c = cfg_for(2);
  {
    Engine a(c, world());
    zs_test::register_model(a, zs_test::uneven_model());
    train_some(a, 1);
    a.save(dir);  // step00000001, published
    train_some(a, 1);
    a.save(dir);  // step00000002
    world()->barrier("saved");
    // The disk as the kill left it: step00000002 in place, `latest` still at step00000001.
    if (world()->rank() == 0) spill(dir / "latest", "step00000001\n");
    world()->barrier("killed");
  }
  Engine b(c, world());
  zs_test::register_model(b, zs_test::uneven_model());
  b.load(dir);
  EXPECT_EQ(b.step_count(), 1);
  train_some(b, 1);
  const fs::path tag = b.save(dir);
  EXPECT_EQ(tag, dir / "step00000002");
  world()->barrier("saved again");
  EXPECT_EQ(slurp(dir / "latest"), "step00000002\n");
  Engine r(c, world());
  zs_test::register_model(r, zs_test::uneven_model());
  r.load(dir);
  EXPECT_TRUE(same(snapshot(b), snapshot(r)));
  // step00000001 is published (older than `latest`'s): never replaced.
  b.load(dir / "step00000001");
  train_some(b, 1);
  EXPECT_ZS_ERROR(b.save(dir, "step00000001"), invalid_argument, "exists");
  cleanup(dir);
}

// Two saves of the same state: a file of one copied into the other is caught by its header.
TEST(CheckpointDamage, AFileOfAnotherSave) {
  const fs::path dir = shared_dir("ckpt-mixed");
  Engine a(cfg_for(2), world());
  zs_test::register_model(a, zs_test::uneven_model());
  a.save(dir, "one");
  a.save(dir, "two");
  world()->barrier("saved twice");
  if (world()->rank() == 0)
    fs::copy_file(dir / "one" / "rank00000.state0", dir / "two" / "rank00000.state0",
                  fs::copy_options::overwrite_existing);
  world()->barrier("mixed");
  EXPECT_THROW(
      {
        try {
          a.load(dir / "two");
        } catch (const Error& e) {
          EXPECT_NE(std::string(e.what()).find("belongs to another save"), std::string::npos)
              << e.what();
          throw;
        }
      },
      Error);
  cleanup(dir);
}

// The same model with its biases in another parameter group: the checkpoint records each
// parameter's group, and a load that would resume them with another group's hyperparameters is
// refused, naming the parameter and both groups.
TEST(CheckpointDamage, AParameterInAnotherGroupIsNamed) {
  const fs::path dir = shared_dir("ckpt-groups");
  Config c = cfg_for(2);
  Engine a(c, world());
  OptimizerOptions biases = c.optimizer;
  biases.weight_decay = 0.0f;
  a.add_group(biases);
  zs_test::register_model(a, zs_test::uneven_model(), /*bias_group=*/1);
  a.save(dir);
  Engine b(c, world());
  b.add_group(biases);
  zs_test::register_model(b, zs_test::uneven_model(), /*bias_group=*/0);
  const Snapshot before = snapshot(b);
  try {
    b.load(dir);
    ADD_FAILURE() << "loaded biases of group 1 into group 0";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::invalid_argument);
    EXPECT_NE(std::string(e.what()).find("in parameter group 1, this engine in group 0"),
              std::string::npos)
        << e.what();
  }
  EXPECT_TRUE(same(before, snapshot(b)));
  cleanup(dir);
}

TEST(CheckpointDamage, AnotherModelIsNamedByItsFirstDifferentParameter) {
  const fs::path dir = shared_dir("ckpt-model");
  Engine a(cfg_for(2), world());
  zs_test::register_model(a, zs_test::uneven_model());
  a.save(dir);
  auto other = zs_test::uneven_model();
  other[2].params[1].second = {14};  // layer1.b
  Engine b(cfg_for(2), world());
  zs_test::register_model(b, other);
  const Snapshot before = snapshot(b);
  try {
    b.load(dir);
    ADD_FAILURE() << "loaded a checkpoint of another model";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::invalid_argument);
    EXPECT_NE(std::string(e.what()).find("unit 2 ('layer1'), parameter 1: the checkpoint has 'b' "
                                         "[13], this engine 'b' [14]"),
              std::string::npos)
        << e.what();
  }
  EXPECT_TRUE(same(before, snapshot(b)));
  cleanup(dir);
}

// The module's tensors the engine does not train (frozen parameters, buffers, in any dtype) and
// the other names of trained parameters go into the checkpoint with rank 0's values, come back
// bitwise, and are exported under every name; above a size limit the model's file is split into
// shards with Hugging Face's index. Names that cannot be told apart are refused before anything
// is written, and a damaged module file is found by verify and by the read.
TEST(CheckpointExport, EveryNameOfTheModelShardedAboveALimit) {
  const fs::path dir = shared_dir("ckpt-module");
  Engine a(cfg_for(2), world());
  zs_test::register_model(a, zs_test::uneven_model());
  train_some(a, 1);
  auto bytes_of = [](const auto& v) {
    const char* p = reinterpret_cast<const char*>(v.data());
    return std::vector<char>(p, p + v.size() * sizeof(v[0]));
  };
  ModuleState mod;
  const std::vector<uint16_t> frozen = {0x3f80, 0x4000, 0xbf80, 0x0000, 0x4040, 0x4080};
  mod.tensors.push_back({"frozen.w", "BF16", {3, 2}, bytes_of(frozen)});
  mod.tensors.push_back({"pos_ids", "I64", {4}, bytes_of(std::vector<int64_t>{0, 1, 2, 3})});
  mod.tensors.push_back({"mask", "BOOL", {2}, {1, 0}});
  mod.tensors.push_back({"empty", "F32", {0, 3}, {}});
  mod.aliases = {{"lm_head.w", "embed.w"}};
  // Rank 0's module is the checkpoint's: another rank's (here nothing) is not read.
  a.save(dir, "m", world()->rank() == 0 ? mod : ModuleState{});
  const ModuleState back = read_module_state(dir / "m");
  ASSERT_EQ(back.tensors.size(), mod.tensors.size());
  for (size_t i = 0; i < mod.tensors.size(); ++i) {
    EXPECT_EQ(back.tensors[i].name, mod.tensors[i].name);
    EXPECT_EQ(back.tensors[i].dtype, mod.tensors[i].dtype);
    EXPECT_EQ(back.tensors[i].shape, mod.tensors[i].shape);
    EXPECT_EQ(back.tensors[i].bytes, mod.tensors[i].bytes) << mod.tensors[i].name;
  }
  EXPECT_EQ(back.aliases, mod.aliases);

  if (world()->rank() == 0) {
    // 2 KB shards: the uneven model's 3.5 KB of f32 weights, the alias and the module's tensors
    // take several.
    export_checkpoint(dir / "m", dir / "out", {}, 2000);
    std::ifstream is(dir / "out" / "model.safetensors.index.json");
    const auto index = nlohmann::json::parse(is);
    const auto& map = index["weight_map"];
    std::set<std::string> files;
    for (auto it = map.begin(); it != map.end(); ++it) files.insert(it.value().get<std::string>());
    EXPECT_GE(files.size(), 2u);
    EXPECT_FALSE(fs::exists(dir / "out" / "model.safetensors")) << "sharded: the index names them";
    for (const char* name :
         {"embed.w", "head.b", "lm_head.w", "frozen.w", "pos_ids", "mask", "empty"})
      EXPECT_TRUE(map.contains(name)) << name;
    auto tensor = [&](const std::string& name) {
      ckpt::StReader r(dir / "out" / map[name].get<std::string>());
      const ckpt::StTensor* t = r.find(name);
      std::vector<char> b(size_t(t->end - t->begin));
      r.read_bytes(*t, b.data());
      return std::make_pair(t->dtype, b);
    };
    EXPECT_EQ(tensor("lm_head.w"), tensor("embed.w")) << "the alias holds its parameter's values";
    EXPECT_EQ(tensor("frozen.w"), std::make_pair(std::string("BF16"), mod.tensors[0].bytes));
    EXPECT_EQ(tensor("pos_ids"), std::make_pair(std::string("I64"), mod.tensors[1].bytes));
    EXPECT_EQ(tensor("mask").second, mod.tensors[2].bytes);
    // Without a limit: one file, every name in it; into the sharded export's directory, whose
    // shards and index go (a loader would take either layout).
    export_checkpoint(dir / "m", dir / "out", {}, 0);
    ckpt::StReader one(dir / "out" / "model.safetensors");
    EXPECT_EQ(one.tensors().size(), map.size());
    EXPECT_FALSE(fs::exists(dir / "out" / "model.safetensors.index.json"));
    for (const std::string& f : files) EXPECT_FALSE(fs::exists(dir / "out" / f)) << f;
    export_checkpoint(dir / "m", dir / "out", {}, 2000);  // and back
    EXPECT_FALSE(fs::exists(dir / "out" / "model.safetensors"));
    EXPECT_TRUE(fs::exists(dir / "out" / "model.safetensors.index.json"));
  }
  world()->barrier("exported");

  // Names that cannot be told apart, refused on every rank; no tag appears.
  auto refused = [&](ModuleState bad, const std::string& text) {
    EXPECT_ZS_ERROR(a.save(dir, "bad", world()->rank() == 0 ? bad : ModuleState{}),
                    invalid_argument, text);
    EXPECT_FALSE(fs::exists(dir / "bad"));
  };
  refused({{{"embed.w", "F32", {1}, bytes_of(std::vector<float>{1})}}, {}},
          "named as a parameter the engine trains");
  refused({{}, {{"x", "nothing.w"}}}, "which is no parameter the engine trains");
  refused({{{"x", "F32", {2}, bytes_of(std::vector<float>{1})}}, {}}, "4 bytes for 2 F32 values");
  refused({{{"x", "C64", {1}, {}}}, {}}, "dtype 'C64'");

  world()->barrier("refused");
  if (world()->rank() == 0)
    flip_byte(dir / "m" / "module.safetensors", size_of(dir / "m" / "module.safetensors") - 2);
  world()->barrier("damaged");
  EXPECT_ZS_ERROR(read_module_state(dir / "m"), corrupted, "fails its checksum");
  EXPECT_ZS_ERROR(verify_checkpoint(dir / "m"), corrupted, "module.safetensors");
  cleanup(dir);
}

// Export to safetensors and back: a fresh engine initialised from the exported model file holds
// the checkpoint's master weights bitwise; a file of another model is refused by name.
TEST(CheckpointExport, SafetensorsRoundTripAndRefusal) {
  const fs::path dir = shared_dir("ckpt-export");
  Engine a(cfg_for(3), world());
  zs_test::register_model(a, zs_test::uneven_model());
  train_some(a, 2);
  a.save(dir);
  world()->barrier("saved");
  if (world()->rank() == 0) {
    export_checkpoint(dir, dir / "export");
    // Not into the tag itself: a saved tag never changes.
    std::ifstream latest(dir / "latest");
    std::string tag;
    std::getline(latest, tag);
    try {
      export_checkpoint(dir, dir / tag / "." / "weights");
      ADD_FAILURE() << "exported into the tag directory";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("inside the checkpoint's tag directory"),
                std::string::npos)
          << e.what();
    }
    EXPECT_FALSE(fs::exists(dir / tag / "weights"));
  }
  world()->barrier("exported");
  ASSERT_TRUE(fs::exists(dir / "export" / "model.safetensors"));
  ASSERT_TRUE(fs::exists(dir / "export" / "optimizer.safetensors"));
  Engine b(cfg_for(1), world());
  zs_test::register_model(b, zs_test::uneven_model());
  b.load_safetensors(dir / "export" / "model.safetensors");
  for (int u = 0; u < a.num_units(); ++u) {
    const auto x = a.read_shard(u, StateKind::master), y = b.read_shard(u, StateKind::master);
    ASSERT_EQ(x.size(), y.size());  // the same shards: the same ranks and alignment
    EXPECT_EQ(std::memcmp(x.data(), y.data(), x.size() * 4), 0) << "unit " << u;
  }
  auto other = zs_test::uneven_model();
  other[4].params[1].first = "bias";  // head.b renamed
  Engine c(cfg_for(1), world());
  zs_test::register_model(c, other);
  const Snapshot before = snapshot(c);
  try {
    c.load_safetensors(dir / "export" / "model.safetensors");
    ADD_FAILURE() << "loaded weights of another model";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("no tensor 'head.bias'"), std::string::npos) << e.what();
  }
  EXPECT_TRUE(same(before, snapshot(c)));
  cleanup(dir);
}

// One rank writes, every rank of this world size reads: each shard is the matching range of
// the one-rank state, bitwise (the other direction is Checkpoint.LoadsAtAnotherStageAndWorldSize).
// Training on from there differs from the one-rank run only by the order of the gradient sums.
TEST(CheckpointResume, FromOneRankToThisWorldSize) {
  const fs::path dir = shared_dir("ckpt-grow");
  // Every rank trains the same one-rank engine (its synthetic gradients are rank 0's).
  Engine solo(cfg_for(2), make_self_communicator());
  zs_test::register_model(solo, zs_test::uneven_model());
  train_some(solo, 3);
  if (world()->rank() == 0) solo.save(dir);
  world()->barrier("solo saved");
  Engine e(cfg_for(3), world());
  zs_test::register_model(e, zs_test::uneven_model());
  e.load(dir);
  EXPECT_EQ(e.step_count(), 3);
  for (int u = 0; u < e.num_units(); ++u) {
    const ShardInfo si = e.shard_info(u);
    for (StateKind k : {StateKind::master, StateKind::state0, StateKind::state1}) {
      const std::vector<float> whole = solo.read_shard(u, k), mine = e.read_shard(u, k);
      for (int64_t j = 0; j < si.shard_numel && si.shard_offset + j < si.numel; ++j)
        ASSERT_EQ(std::memcmp(&mine[size_t(j)], &whole[size_t(si.shard_offset + j)], 4), 0)
            << "unit " << u << " element " << si.shard_offset + j;
    }
  }
  cleanup(dir);
}

// A bf16 master (Config::bf16_master) resumes bitwise on every tier, at another stage, also
// from an asynchronous save (the nvme tier's snapshot widens it from its records); its files
// hold it as f32, so an f32-master engine loads it exactly, and a bf16-master engine loads
// that engine's checkpoint back to the same bits.
TEST(CheckpointResume, BF16MasterBitwiseAndIntoAnF32Master) {
  const fs::path dir = shared_dir("ckpt-bf16-master");
  auto bf16 = [](int stage, Tier tier) {
    Config c = cfg_for(stage, tier);
    c.bf16_master = true;
    return c;
  };
  int n = 0;
  for (Tier tier : {Tier::device, Tier::host, Tier::nvme}) {
    Engine a(bf16(3, tier), world());
    zs_test::register_model(a, zs_test::uneven_model());
    train_some(a, 3);
    const std::string tag = "m" + std::to_string(n++);
    a.save_async(dir, tag);
    const Snapshot saved = snapshot(a);
    train_some(a, 1);  // while the files are written
    a.finish_save();
    Engine b(bf16(1, tier), world());
    zs_test::register_model(b, zs_test::uneven_model());
    b.load(dir / tag);
    EXPECT_TRUE(same(snapshot(b), saved)) << tier_name(tier);
    EXPECT_EQ(b.step_count(), 3);
    train_some(b, 1);  // the same step, rounded with the same bits
    EXPECT_TRUE(same(snapshot(a), snapshot(b))) << tier_name(tier);

    Engine f(cfg_for(2, tier), world());  // f32 master
    zs_test::register_model(f, zs_test::uneven_model());
    f.load(dir / tag);
    EXPECT_TRUE(same(snapshot(f), saved)) << tier_name(tier);
    f.save(dir, tag + "f32");
    Engine g(bf16(2, tier), world());
    zs_test::register_model(g, zs_test::uneven_model());
    g.load(dir / (tag + "f32"));
    EXPECT_TRUE(same(snapshot(g), saved)) << tier_name(tier);
  }
  cleanup(dir);
}

namespace {

// The uneven model and a unit "wide" of rows × 1024 parameters.
std::vector<zs_test::UnitSpec> with_wide(int64_t rows) {
  auto m = zs_test::uneven_model();
  m.push_back({"wide", {{"w", {rows, 1024}}}});
  return m;
}

}  // namespace

// save_async() with the state in host memory returns before its copy of the state is made (its
// thread makes it): a step called at once, between backward and step() as a trainer may save,
// waits for the copy before it changes the state. Without that wait the step's update runs
// beside the copy, which then takes the moments of the first units as updated.
TEST(CheckpointAsync, TheStepRightAfterTheCallWaitsForItsCopy) {
  const fs::path dir = shared_dir("ckpt-async-copy");
  const auto big = with_wide(2048);  // 24 MB of state: its copy takes a while
  Engine a(cfg_for(2, Tier::host), world());
  zs_test::register_model(a, big);
  train_some(a, 1);
  Snapshot at_call;
  zs_test::TrainOptions o;
  o.steps = 1;
  o.before_step = [&](Engine& e) {
    at_call = snapshot(e);
    e.save_async(dir, "async");
  };
  zs_test::train(a, o);  // step() right after the call
  a.finish_save();
  EXPECT_FALSE(same(snapshot(a), at_call)) << "the step changed nothing";
  Engine b(cfg_for(2, Tier::host), world());
  zs_test::register_model(b, big);
  b.load(dir / "async");
  EXPECT_TRUE(same(snapshot(b), at_call)) << "the checkpoint is not the state of its call";
  cleanup(dir);
}

// save_async(): the checkpoint holds the state of the moment it was called, though training
// went on while it was written; the snapshot is in the ledger.
TEST(CheckpointAsync, HoldsTheStateOfItsCallWhileTrainingGoesOn) {
  const fs::path dir = shared_dir("ckpt-async");
  const auto big = with_wide(1024);  // 12 MB of state: the writer takes a while
  Engine a(cfg_for(2, Tier::host), world());
  zs_test::register_model(a, big);
  train_some(a, 2);
  a.save(dir, "sync");
  a.save_async(dir, "async");
  bool counted = false;
  for (const NamedBuffer& b : a.memory().buffers)
    counted |= b.name == "checkpoint_snapshot" && b.bytes > 0;
  EXPECT_TRUE(counted) << "the snapshot is not in the ledger";
  train_some(a, 2);  // changes every state while the files are written
  EXPECT_EQ(a.finish_save(), dir / "async");
  EXPECT_EQ(a.finish_save(), fs::path()) << "nothing pending any more";
  Engine x(cfg_for(2), world()), y(cfg_for(2), world());
  zs_test::register_model(x, big);
  zs_test::register_model(y, big);
  x.load(dir / "sync");
  y.load(dir / "async");
  EXPECT_TRUE(same(snapshot(x), snapshot(y)));
  EXPECT_EQ(y.step_count(), 2);
  // A pending save is finished by the next save.
  a.save_async(dir, "pending");
  a.save(dir, "after");
  EXPECT_TRUE(fs::exists(dir / "pending" / "manifest.json"));
  cleanup(dir);
}

namespace {

int64_t snapshot_in_ledger(const MemoryReport& r) {
  int64_t held = 0;
  for (const NamedBuffer& b : r.buffers)
    if (b.name == "checkpoint_snapshot") held += b.bytes;
  return held;
}

}  // namespace

// Config::checkpoint_async: finalize() makes the snapshot, as many bytes as the first
// save_async() makes without it, and the ledger and a plan count it from then on. A save made at
// once (its pages may still be being faulted in) holds the state of its call, and the next ones
// reuse the snapshot. The nvme tier makes none: its swap files hold its snapshot, and neither do
// the ranks of a shard group that does not write.
TEST(CheckpointAsync, CheckpointAsyncMakesTheSnapshotInFinalize) {
  const fs::path dir = shared_dir("ckpt-async-finalize");
  const auto big = with_wide(1024);
  std::vector<PlanUnit> plan_units;
  for (const zs_test::UnitSpec& u : big) {
    PlanUnit pu{u.name, {}};
    for (const auto& [name, shape] : u.params) pu.params.push_back(Param{name, shape});
    plan_units.push_back(pu);
  }
  for (const Config& lazy_cfg : {cfg_for(2, Tier::host), cfg_for(3, Tier::host, StateFormat::q8)}) {
    const std::string what = "stage " + std::to_string(lazy_cfg.stage) + ", " +
                             state_format_name(lazy_cfg.optimizer_state) + " moments";
    Engine lazy(lazy_cfg, world());
    zs_test::register_model(lazy, big);
    EXPECT_EQ(snapshot_in_ledger(lazy.memory()), 0) << what << ": made without checkpoint_async";
    train_some(lazy, 1);
    lazy.save_async(dir, "lazy");
    EXPECT_EQ(lazy.finish_save(), dir / "lazy");
    const int64_t bytes = snapshot_in_ledger(lazy.memory());
    ASSERT_GT(bytes, 0) << what;

    Config c = lazy_cfg;
    c.checkpoint_async = true;
    EXPECT_EQ(snapshot_in_ledger(plan_memory(c, plan_units, world()->size(), world()->rank())),
              bytes)
        << what << ": the plan does not count the snapshot";
    Engine a(c, world());
    zs_test::register_model(a, big);
    EXPECT_EQ(snapshot_in_ledger(a.memory()), bytes)
        << what << ": finalize() made no snapshot of that size";
    train_some(a, 1);
    for (const std::string tag : {"first", "second"}) {
      const Snapshot at_call = snapshot(a);
      a.save_async(dir, tag);
      train_some(a, 1);  // waits for the copy, then changes every state
      EXPECT_EQ(a.finish_save(), dir / tag);
      EXPECT_EQ(snapshot_in_ledger(a.memory()), bytes) << what << ": a second snapshot";
      Engine b(lazy_cfg, world());
      zs_test::register_model(b, big);
      b.load(dir / tag);
      EXPECT_TRUE(same(snapshot(b), at_call)) << what << ", " << tag << ": not its call's state";
    }
    {
      Engine right_away(c, world());  // destroyed while its snapshot may still be faulted in
      zs_test::register_model(right_away, big);
    }
    cleanup(dir);
  }
  Config nvme = cfg_for(2, Tier::nvme);
  nvme.checkpoint_async = true;
  Engine n(nvme, world());
  zs_test::register_model(n, big);
  EXPECT_EQ(snapshot_in_ledger(n.memory()), 0) << "the nvme tier's snapshot made in memory";
  // Hierarchical sharding: only the first group writes, so only its ranks hold a snapshot.
  Config groups = cfg_for(2, Tier::host);
  groups.checkpoint_async = true;
  groups.shard_group_size = 1;
  Engine g(groups, world());
  zs_test::register_model(g, big);
  EXPECT_EQ(snapshot_in_ledger(g.memory()) > 0, g.shard_group().index == 0)
      << "shard group " << g.shard_group().index;
  cleanup(dir);
}

// Hyperparameters this engine cannot take (an SGD momentum that would turn its buffer on) are
// refused with the rest of the checks, before any state changes.
// On the nvme tier the snapshot is the tier's committed record slots, not a copy in memory (the
// ledger holds one record for it); the steps that follow write around it, the second one waiting
// for every unit the save has not read yet. The asynchronous checkpoint is the synchronous one.
// With the speculative step, the tier's thread writes those slots during backward, and waits the
// same way.
TEST(CheckpointAsync, NvmeTierKeepsItsSnapshotInItsRecordSlots) {
  const fs::path dir = shared_dir("ckpt-async-nvme");
  std::vector<zs_test::UnitSpec> many;
  for (int u = 0; u < 24; ++u)
    many.push_back({"layer" + std::to_string(u), {{"w", {256, 256}}, {"b", {256}}}});
  Config cfg = cfg_for(2, Tier::nvme);
  for (bool speculative : {false, true}) {
    cfg.speculative_step = speculative ? SpeculativeStep::on : SpeculativeStep::off;
    Engine a(cfg, world());
    zs_test::register_model(a, many);
    train_some(a, 1);
    int64_t state = 0;
    for (int u = 0; u < a.num_units(); ++u) state += a.shard_info(u).shard_numel * 12;
    for (int round = 0; round < 3; ++round) {
      const std::string tag = "r" + std::to_string(round) + (speculative ? "spec" : "");
      a.save(dir, tag + "sync");
      a.save_async(dir, tag + "async");
      int64_t held = -1;
      for (const NamedBuffer& b : a.memory().buffers)
        if (b.name == "checkpoint_snapshot") held = b.bytes;
      EXPECT_GT(held, 0) << "the snapshot is not in the ledger";
      EXPECT_LT(held, state / 8) << "the nvme tier's snapshot was copied into memory";
      train_some(a, 2);  // the second step writes the slots the snapshot holds
      EXPECT_EQ(a.finish_save(), dir / (tag + "async"));
      Engine x(cfg_for(2), world()), y(cfg_for(2), world());
      zs_test::register_model(x, many);
      zs_test::register_model(y, many);
      x.load(dir / (tag + "sync"));
      y.load(dir / (tag + "async"));
      EXPECT_TRUE(same(snapshot(x), snapshot(y))) << tag;
    }
  }
  cleanup(dir);
}

TEST(CheckpointDamage, HyperparametersTheEngineCannotTakeChangeNothing) {
  const fs::path dir = shared_dir("ckpt-hyper");
  Config c = cfg_for(2);
  c.optimizer.kind = OptimizerKind::sgd;
  c.optimizer.momentum = 0.9f;
  Engine a(c, world());
  zs_test::register_model(a, zs_test::uneven_model());
  train_some(a, 1);
  a.save(dir);
  c.optimizer.momentum = 0;
  Engine b(c, world());
  zs_test::register_model(b, zs_test::uneven_model());
  const Snapshot before = snapshot(b);
  try {
    b.load(dir);
    ADD_FAILURE() << "took a momentum that turns the buffer on";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("turns the momentum buffer on or off"), std::string::npos)
        << e.what();
  }
  EXPECT_TRUE(same(before, snapshot(b)));
  EXPECT_EQ(b.step_count(), 0);
  cleanup(dir);
}

// Tensors of zero elements sit at the same offset as the one after them: an export with one
// loads back (the reader orders tensors by begin, then end).
TEST(CheckpointExport, ZeroSizedParametersRoundTrip) {
  const fs::path dir = shared_dir("ckpt-empty");
  const std::vector<zs_test::UnitSpec> model = {{"u", {{"a", {2}}, {"c", {0}}, {"b", {2}}}}};
  Engine a(cfg_for(1), world());
  zs_test::register_model(a, model);
  train_some(a, 1);
  a.save(dir);
  world()->barrier("saved");
  if (world()->rank() == 0) export_checkpoint(dir, dir / "export");
  world()->barrier("exported");
  Engine b(cfg_for(1), world());
  zs_test::register_model(b, model);
  b.load_safetensors(dir / "export" / "model.safetensors");
  const auto x = a.read_shard(0, StateKind::master), y = b.read_shard(0, StateKind::master);
  EXPECT_EQ(std::memcmp(x.data(), y.data(), x.size() * 4), 0);
  cleanup(dir);
}
