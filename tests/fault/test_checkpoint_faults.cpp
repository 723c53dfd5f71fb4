// A checkpoint save that runs out of disk for real: the root is a small file system of 2 MiB
// (mounted by rank 0, shared by the ranks of this machine; root is needed, as CI has): an ext4
// image on a loop device, where the data files are written with O_DIRECT, and a tmpfs, which
// refuses O_DIRECT so that they go through the page cache. The first save fits, the second
// cannot: every rank gets Error(no_space), nothing of the failed save is left, `latest` still
// names the first tag, and it loads into an engine that then holds the first save's state.
#include <gtest/gtest.h>
#include <sys/mount.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "tests/multirank/harness.hpp"

using namespace zeroshard;
using zs_test::world;
namespace fs = std::filesystem;

namespace {

// ~1.4 MB of f32 state per save (3 states × 120 000 values).
std::vector<zs_test::UnitSpec> model() {
  return {{"a", {{"w", {200, 200}}}}, {"b", {{"w", {200, 200}}}}, {"c", {{"w", {200, 200}}}}};
}

Config config() {
  Config c;
  c.stage = 2;
  c.dtype = DType::bf16;
  c.optimizer.lr = 1e-2f;
  return c;
}

std::vector<std::vector<float>> masters(const Engine& e) {
  std::vector<std::vector<float>> m;
  for (int u = 0; u < e.num_units(); ++u) m.push_back(e.read_shard(u, StateKind::master));
  return m;
}

// Mounts a 2 MiB file system of `kind` ("ext4" on a loop device, or "tmpfs") at a new directory
// on rank 0; returns it, or an empty path on every rank where that is refused.
fs::path mount_small(const std::string& kind) {
  double id = world()->rank() == 0 ? double(::getpid()) : 0;
  world()->all_reduce(&id, 1, ReduceOp::max, "full-disk dir")->wait();
  const fs::path root = "/tmp/zeroshard-ckpt-full-" + kind + "-" + std::to_string(int64_t(id));
  double failed = 0;
  if (world()->rank() == 0) {
    fs::create_directories(root);
    if (kind == "tmpfs") {
      failed = ::mount("tmpfs", root.c_str(), "tmpfs", 0, "size=2m,mode=0755") == 0 ? 0 : 1;
    } else {
      const std::string image = root.string() + ".img";
      const std::string cmd = "truncate -s 2M " + image +
                              " && mkfs.ext4 -q -F -O ^has_journal -m 0 " + image +
                              " && mount -o loop " + image + " " + root.string();
      failed = std::system((cmd + " 2>/dev/null").c_str()) == 0 ? 0 : 1;
      fs::remove(image);  // the loop device holds it open while mounted
    }
  }
  world()->all_reduce(&failed, 1, ReduceOp::max, "full-disk mounted")->wait();
  if (failed > 0) {
    if (world()->rank() == 0) fs::remove(root);
    return {};
  }
  return root;
}

void unmount(const fs::path& root) {
  world()->barrier("before unmount");
  if (world()->rank() == 0) {
    ::umount2(root.c_str(), MNT_DETACH);
    fs::remove(root);
  }
}

class CheckpointFaults : public ::testing::TestWithParam<std::string> {};

}  // namespace

TEST_P(CheckpointFaults, FullDiskFailsEveryRankAndKeepsThePreviousTag) {
  const fs::path mnt = mount_small(GetParam());
  if (mnt.empty())
    GTEST_SKIP() << "mounting a " << GetParam()
                 << " needs root (and loop devices and mkfs.ext4 for ext4; CI has them)";
  const fs::path root = mnt / "run";  // ext4's root holds lost+found

  Engine e(config(), world());
  zs_test::register_model(e, model());
  zs_test::TrainOptions o;
  o.steps = 1;
  zs_test::train(e, o);
  e.save(root);
  const auto first = masters(e);
  zs_test::train(e, o);
  try {
    e.save(root);
    ADD_FAILURE() << "a save larger than the free space succeeded";
  } catch (const Error& err) {
    EXPECT_EQ(err.code(), ErrorCode::no_space) << err.what();
    EXPECT_NE(std::string(err.what()).find("disk is full"), std::string::npos) << err.what();
  }
  world()->barrier("after the failed save");
  std::vector<std::string> left;
  for (const auto& d : fs::directory_iterator(root)) left.push_back(d.path().filename());
  std::sort(left.begin(), left.end());
  EXPECT_EQ(left, (std::vector<std::string>{"latest", "step00000001"}))
      << "the failed save left something behind";
  std::ifstream latest(root / "latest");
  std::string tag;
  std::getline(latest, tag);
  EXPECT_EQ(tag, "step00000001");

  Engine back(config(), world());
  zs_test::register_model(back, model());
  back.load(root);
  const auto got = masters(back);
  for (size_t u = 0; u < got.size(); ++u)
    EXPECT_EQ(std::memcmp(got[u].data(), first[u].data(), got[u].size() * 4), 0) << "unit " << u;
  EXPECT_EQ(back.step_count(), 1);

  unmount(mnt);
}

// A disk already full when a save begins: even creating the tag's temporary directory fails,
// and that is Error(no_space) too, like every later failure of a save (it was io_error).
TEST_P(CheckpointFaults, AFullDiskBeforeTheSaveBeginsIsNoSpace) {
  const fs::path mnt = mount_small(GetParam());
  if (mnt.empty())
    GTEST_SKIP() << "mounting a " << GetParam()
                 << " needs root (and loop devices and mkfs.ext4 for ext4; CI has them)";
  if (world()->rank() == 0) {  // fill it: a file of zeros until the disk refuses more
    std::ofstream fill(mnt / "fill", std::ios::binary);
    const std::string mib(1 << 20, '\0');
    for (int i = 0; i < 8 && fill; ++i) fill.write(mib.data(), std::streamsize(mib.size()));
  }
  world()->barrier("filled");
  Engine e(config(), world());
  zs_test::register_model(e, model());
  try {
    e.save(mnt / "run");
    ADD_FAILURE() << "a save onto a full disk succeeded";
  } catch (const Error& err) {
    EXPECT_EQ(err.code(), ErrorCode::no_space) << err.what();
  }
  unmount(mnt);
}

INSTANTIATE_TEST_SUITE_P(FileSystems, CheckpointFaults, ::testing::Values("ext4", "tmpfs"),
                         [](const auto& p) { return p.param; });
