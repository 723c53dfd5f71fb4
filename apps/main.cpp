// The `zeroshard` command-line tool: one executable, one subcommand per job. Each subcommand
// parses its own flags; this file only dispatches.
#ifdef ZSDEMO_HAVE_BLAS
#include <cblas.h>
#endif
#include <strings.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "apps/ckpt/ckpt.hpp"
#include "apps/cli/capacity.hpp"
#include "apps/cli/config_cmd.hpp"
#include "apps/demo.hpp"
#include "apps/plan/calibrate.hpp"
#include "apps/plan/plan.hpp"
#include "zeroshard/communicator.hpp"
#include "zeroshard/version.hpp"

namespace {

// OpenBLAS picks its kernels from the CPU model at load time, and Debian 12's 0.3.21 predates
// recent Xeons (Sapphire and Emerald Rapids): on them it falls back to its SSE3 "Prescott"
// kernels, 2-3x slower than its AVX-512 ones. The choice can only be forced through
// OPENBLAS_CORETYPE before the library initialises, which happens before main(); so when the
// CPU has the instructions but OpenBLAS chose an older core, set it and re-execute once. A user's
// own OPENBLAS_CORETYPE always wins; if exec fails the program simply goes on.
void pick_openblas_core(char** argv) {
#ifndef ZSDEMO_HAVE_BLAS
  (void)argv;
  return;
#else
  if (std::getenv("OPENBLAS_CORETYPE")) return;
  const char* core = openblas_get_corename();
  auto is = [&](std::initializer_list<const char*> names) {
    for (const char* n : names)
      if (core && strcasecmp(core, n) == 0) return true;
    return false;
  };
  const char* want = nullptr;
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl")) {
    if (!is({"SkylakeX", "Cooperlake", "SapphireRapids"})) want = "SkylakeX";
  } else if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
    if (!is({"Haswell", "Zen", "SkylakeX", "Cooperlake", "SapphireRapids"})) want = "Haswell";
  }
  if (!want) return;
  setenv("OPENBLAS_CORETYPE", want, 1);
  execv("/proc/self/exe", argv);
#endif
}

struct Command {
  const char* name;
  const char* summary;
  int (*run)(const std::vector<std::string>& args);
};

constexpr Command kCommands[] = {
    {"demo", "train a small GPT on N MPI ranks with ZeRO sharding; report memory and step time",
     &zsdemo::run_demo},
    {"ckpt", "inspect or verify a checkpoint without launching ranks (ckpt --help)",
     &zsckpt::run_ckpt},
    {"plan", "the memory per rank of every stage and offload choice for a GPT (plan --help)",
     &zsplan::run_plan},
    {"calibrate", "measure memory, CPU optimizer, collective and disk rates for the planner",
     &zsplan::run_calibrate},
    {"capacity", "the largest model that trains under given budgets, with plots (python)",
     &zscli::run_capacity},
    {"config", "read and check a JSON configuration (zeroshard's or DeepSpeed's keys)",
     &zscli::run_config},
};

void usage(std::FILE* out) {
  std::fprintf(out,
               "usage: zeroshard <command> [flags]\n"
               "       zeroshard <command> --help\n"
               "       zeroshard --version\n\ncommands:\n");
  for (const Command& c : kCommands) std::fprintf(out, "  %-10s %s\n", c.name, c.summary);
  std::fprintf(out, "\nexample: mpirun -np 4 zeroshard demo --stage 3\n");
}

}  // namespace

int main(int argc, char** argv) {
  pick_openblas_core(argv);
  if (argc < 2) {
    usage(stderr);
    return 2;
  }
  const std::string cmd = argv[1];
  if (cmd == "--help" || cmd == "-h" || cmd == "help") {
    usage(stdout);
    return 0;
  }
  if (cmd == "--version") {
    std::printf("zeroshard %s\n", zeroshard::version());
    return 0;
  }
  for (const Command& c : kCommands) {
    if (cmd != c.name) continue;
    const int rc = c.run(std::vector<std::string>(argv + 2, argv + argc));
    // A rank that failed on its own ends the job now: returning would wait in MPI_Finalize for
    // peers that wait for it in a collective until their timeout.
    if (rc != 0) zeroshard::abort_mpi_job(rc);
    return rc;
  }
  std::fprintf(stderr, "zeroshard: unknown command '%s'\n\n", cmd.c_str());
  usage(stderr);
  return 2;
}
