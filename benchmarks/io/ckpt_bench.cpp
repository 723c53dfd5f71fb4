// Checkpoint save and load bandwidth: one rank, stage 1, bf16 parameters with the f32 master
// weights and both AdamW moments on the host tier (12 bytes of checkpoint data per parameter),
// after one step so that the moments are not zero. Per round: save() a new tag (timed, fsyncs
// included), drop the page cache (root), load() it into the same engine (timed: one pass,
// every block verified as it lands in the state), and a step
// between rounds; then the step time while a save_async() writes, against steps alone.
// ckpt_vs_fio.sh runs it against fio.
// --state bf16|8bit keeps the moments in that format (the parameter count stays size / 12): the
// checkpoint shrinks with them, and bytes/s are of what the files really hold.
//
//   ckpt_bench --dir DIR --size 2G [--rounds 3] [--units 16] [--state f32|bf16|8bit]
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "benchmarks/io/parse_size.hpp"
#include "zeroshard/zeroshard.hpp"

using namespace zeroshard;

namespace {

double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// Drops clean page-cache pages, so that a read comes from the disk (needs root).
bool drop_caches() {
  ::sync();
  std::ofstream f("/proc/sys/vm/drop_caches");
  return static_cast<bool>(f << "3\n") && static_cast<bool>(f.flush());
}

void one_step(Engine& e) {
  for (int u = e.num_units() - 1; u >= 0; --u) {
    std::vector<TensorView> g = e.grads(u);
    for (TensorView& t : g)
      for (int64_t i = 0; i < t.numel; ++i) static_cast<uint16_t*>(t.data)[i] = 0x3c00;  // 1/128
    e.grads_ready(u);
  }
  e.step();
}

}  // namespace

int main(int argc, char** argv) {
  std::string dir;
  int64_t size = int64_t(2) << 30;
  int rounds = 3, units = 16;
  std::string state = "f32";
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i], v = argv[i + 1];
    if (k == "--dir")
      dir = v;
    else if (k == "--size")
      size = bench::parse_size(v);
    else if (k == "--rounds")
      rounds = std::stoi(v);
    else if (k == "--units")
      units = std::stoi(v);
    else if (k == "--state")
      state = v;
    else {
      std::fprintf(stderr, "unknown flag %s\n", k.c_str());
      return 2;
    }
  }
  if (dir.empty()) {
    std::fprintf(stderr,
                 "usage: ckpt_bench --dir DIR --size 2G [--rounds 3] [--units 16] "
                 "[--state f32|bf16|8bit]\n");
    return 2;
  }
  const int64_t per = size / 12 / units;
  Config c;
  c.stage = 1;
  c.dtype = DType::bf16;
  c.offload_optimizer.tier = Tier::host;
  c.optimizer_state = state == "8bit"   ? StateFormat::q8
                      : state == "bf16" ? StateFormat::bf16
                                        : StateFormat::f32;
  if (state_format_name(c.optimizer_state) != state) {
    std::fprintf(stderr, "--state: f32, bf16 or 8bit, not %s\n", state.c_str());
    return 2;
  }
  Engine e(c, make_self_communicator());
  for (int u = 0; u < units; ++u) e.add_unit("layer" + std::to_string(u), {Param{"w", {per}}});
  e.finalize();
  one_step(e);
  const std::filesystem::path root = std::filesystem::path(dir) / "ckpt_bench";
  std::filesystem::remove_all(root);
  std::printf("%-6s %10s %10s %10s %10s %10s\n", "round", "save_s", "save_MB/s", "load_s",
              "load_MB/s", "file_MB");
  bool cold = true;
  double t = 0;
  for (int r = 1; r <= rounds; ++r) {
    t = now();
    const std::filesystem::path tag = e.save(root, "r" + std::to_string(r));
    const double save_s = now() - t;
    double bytes = 0;  // what the tag's files hold
    for (const auto& f : std::filesystem::directory_iterator(tag)) bytes += double(f.file_size());
    cold &= drop_caches();
    t = now();
    e.load(tag);
    const double load_s = now() - t;
    std::printf("%-6d %10.3f %10.1f %10.3f %10.1f %10.1f\n", r, save_s, bytes / save_s / 1e6,
                load_s, bytes / load_s / 1e6, bytes / 1e6);
    std::fflush(stdout);
    std::filesystem::remove_all(tag);
    one_step(e);
  }
  // The step-time cost of an asynchronous save: steps alone, then the same steps while
  // save_async()'s thread writes, then what finish_save() still waits for. Twice: the first
  // save_async() allocates its snapshot, later ones reuse it.
  const int k = 5;
  for (int a = 1; a <= 2; ++a) {
    t = now();
    for (int i = 0; i < k; ++i) one_step(e);
    const double alone = (now() - t) / k;
    t = now();
    e.save_async(root, "async" + std::to_string(a));
    const double snap = now() - t;
    t = now();
    for (int i = 0; i < k; ++i) one_step(e);
    const double during = (now() - t) / k;
    t = now();
    e.finish_save();
    const double wait = now() - t;
    std::printf(
        "async save %d: save_async() %.2f s; step %.3f s alone, %.3f s while the save "
        "writes (%.2fx); finish_save() waited %.2f s more\n",
        a, snap, alone, during, during / alone, wait);
  }
  if (!cold) std::printf("(page cache not dropped: not root; loads may read from memory)\n");
  std::filesystem::remove_all(root);
  return 0;
}
