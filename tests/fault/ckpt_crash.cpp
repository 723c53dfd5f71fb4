// The two halves of the checkpoint crash test (run_ckpt_crash.sh), under mpirun:
//   ckpt_crash save-loop ROOT   trains and saves a new tag after every step, forever (the script
//                               kills every rank with SIGKILL in the middle of a save);
//   ckpt_crash resume ROOT      loads ROOT's latest tag, replays the same number of steps from
//                               scratch in a second engine, and checks that both hold the same
//                               state bitwise, before and after two more steps. Exit 0 if so;
//   ckpt_crash load ROOT        only loads it (at another world size, where a replay would sum
//                               in another order and so not be bitwise) and trains a step.
// A last argument TIMEOUT_S sets the collective timeout (the host-loss test cuts a host off in
// the middle of save-loop and waits for the others' errors).
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "tests/multirank/harness.hpp"
#include "zeroshard/zeroshard.hpp"

using namespace zeroshard;

namespace {

Config config() {
  Config c;
  c.stage = 2;
  c.dtype = DType::bf16;
  c.offload_optimizer.tier = Tier::host;
  c.optimizer.lr = 1e-2f;
  c.checkpoint_keep_last = 3;
  return c;
}

// Large enough that a save takes a while (3 states × 4 B × 6 M values = 72 MB per save).
std::vector<zs_test::UnitSpec> model() {
  std::vector<zs_test::UnitSpec> m;
  for (int u = 0; u < 6; ++u)
    m.push_back({"block" + std::to_string(u), {{"w", {1000, 1000}}, {"b", {1000}}}});
  return m;
}

bool same_state(const Engine& a, const Engine& b) {
  for (int u = 0; u < a.num_units(); ++u)
    for (StateKind k :
         {StateKind::param, StateKind::master, StateKind::state0, StateKind::state1}) {
      const auto x = a.read_shard(u, k), y = b.read_shard(u, k);
      if (x.size() != y.size() || std::memcmp(x.data(), y.data(), x.size() * 4) != 0) return false;
    }
  return true;
}

bool everywhere(Communicator& comm, bool ok) {
  double v = ok ? 0 : 1;
  comm.all_reduce(&v, 1, ReduceOp::max, "crash test outcome")->wait();
  return v == 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 3 && argc != 4) {
    std::fprintf(stderr, "usage: ckpt_crash save-loop|resume|load ROOT [TIMEOUT_S]\n");
    return 2;
  }
  const std::string mode = argv[1], root = argv[2];
  Config cfg = config();
  if (argc == 4) cfg.collective_timeout_s = std::atof(argv[3]);
  auto comm = make_mpi_communicator();
  zs_test::TrainOptions one;
  one.steps = 1;
  try {
    Engine e(cfg, comm);
    zs_test::register_model(e, model());
    if (mode == "save-loop") {
      for (;;) {
        zs_test::train(e, one);
        e.save(root);
        if (comm->rank() == 0) std::printf("saved step %lld\n", (long long)e.step_count());
        std::fflush(stdout);
      }
    }
    e.load(root);
    const int64_t steps = e.step_count();
    if (mode == "load") {
      zs_test::train(e, one);
      if (comm->rank() == 0) std::printf("loaded step %lld and trained on\n", (long long)steps);
      return 0;
    }
    Engine replay(cfg, comm);
    zs_test::register_model(replay, model());
    // One step per call, as save-loop trained (the harness's gradients depend on the step's
    // index within a call).
    for (int64_t s = 0; s < steps; ++s) zs_test::train(replay, one);
    bool ok = everywhere(*comm, same_state(e, replay));
    for (int s = 0; s < 2; ++s) {
      zs_test::train(e, one);
      zs_test::train(replay, one);
    }
    ok = everywhere(*comm, ok && same_state(e, replay));
    if (comm->rank() == 0)
      std::printf("resumed at step %lld: %s\n", (long long)steps,
                  ok ? "bitwise equal to the uninterrupted run" : "DIFFERENT");
    return ok ? 0 : 1;
  } catch (const Error& e) {
    std::fprintf(stderr, "ckpt_crash %s: %s\n", mode.c_str(), e.what());
    return 1;
  }
}
