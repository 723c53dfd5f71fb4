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
// --backward S: each iteration of the asynchronous-save part first waits S seconds, as a trainer
// waits for a GPU's forward and backward.
// --checkpoint-async 1: Config::checkpoint_async, so finalize() makes the snapshot and faults it
// in on a thread; the iterations right after finalize() are timed (they run beside that thread).
//
//   ckpt_bench --dir DIR --size 2G [--rounds 3] [--units 16] [--state f32|bf16|8bit]
//              [--backward S] [--async-iterations 5] [--checkpoint-async 0|1]
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>
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
  int rounds = 3, units = 16, iterations = 5;
  double backward_s = 0;
  bool reserve = false;
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
    else if (k == "--backward")
      backward_s = std::stod(v);
    else if (k == "--async-iterations")
      iterations = std::stoi(v);
    else if (k == "--checkpoint-async")
      reserve = std::stoi(v) != 0;
    else {
      std::fprintf(stderr, "unknown flag %s\n", k.c_str());
      return 2;
    }
  }
  if (dir.empty() || iterations < 1 || rounds < 1) {
    std::fprintf(stderr,
                 "usage: ckpt_bench --dir DIR --size 2G [--rounds 3] [--units 16] "
                 "[--state f32|bf16|8bit] [--backward S] [--async-iterations 5] "
                 "[--checkpoint-async 0|1]\n");
    return 2;
  }
  const int64_t per = size / 12 / units;
  Config c;
  c.stage = 1;
  c.dtype = DType::bf16;
  c.offload_optimizer.tier = Tier::host;
  c.checkpoint_async = reserve;
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
  // The trainer's first iterations, right after finalize() (beside the thread that faults the
  // snapshot in, with --checkpoint-async 1): compared below with iterations alone.
  auto iteration = [&] {
    if (backward_s > 0) std::this_thread::sleep_for(std::chrono::duration<double>(backward_s));
    one_step(e);
  };
  const int k = iterations;
  double t = now();
  for (int i = 0; i < k; ++i) iteration();
  const double first = (now() - t) / k;
  const std::filesystem::path root = std::filesystem::path(dir) / "ckpt_bench";
  std::filesystem::remove_all(root);
  std::printf("%-6s %10s %10s %10s %10s %10s\n", "round", "save_s", "save_MB/s", "load_s",
              "load_MB/s", "file_MB");
  bool cold = true;
  double last_save_s = 0;
  for (int r = 1; r <= rounds; ++r) {
    t = now();
    const std::filesystem::path tag = e.save(root, "r" + std::to_string(r));
    const double save_s = now() - t;
    last_save_s = save_s;
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
  // The cost of an asynchronous save to the trainer. An iteration is the trainer's: it waits
  // `backward` s (the CPU idle, as while a GPU runs forward and backward), writes its gradients
  // and steps. k iterations alone, then k right after save_async() while its thread copies and
  // writes, then what finish_save() still waits for. The trainer is blocked by the save for the
  // time save_async() takes plus what the k iterations take longer; the save's own duration is
  // the synchronous save()'s of the last round. Twice: the first save_async() allocates its
  // snapshot (unless finalize() did), later ones reuse it.
  for (int a = 1; a <= 2; ++a) {
    t = now();
    for (int i = 0; i < k; ++i) iteration();
    const double alone = (now() - t) / k;
    t = now();
    e.save_async(root, "async" + std::to_string(a));
    const double snap = now() - t;
    t = now();
    for (int i = 0; i < k; ++i) iteration();
    const double during = (now() - t) / k;
    t = now();
    e.finish_save();
    const double wait = now() - t;
    const double blocked = snap + k * std::max(0.0, during - alone);
    std::printf(
        "async save %d: save_async() %.3f s; iteration %.3f s alone, %.3f s while the save "
        "runs (%.2fx); finish_save() waited %.2f s more; blocked %.3f s in all = %.3f of the "
        "save's %.3f s\n",
        a, snap, alone, during, during / alone, wait, blocked, blocked / last_save_s, last_save_s);
    if (a == 1)
      std::printf("first %d iterations after finalize(): %.3f s each (%.2fx alone)%s\n", k, first,
                  first / alone, reserve ? ", beside the thread faulting the snapshot in" : "");
  }
  if (!cold) std::printf("(page cache not dropped: not root; loads may read from memory)\n");
  std::filesystem::remove_all(root);
  return 0;
}
