// launch_info(): the launcher's environment variables, read in one place for the engine (which
// GPU, how many CPU threads), the communicators and the clients.

#include <cstdlib>
#include <string>

#include "zeroshard/launch.hpp"

namespace zeroshard {
namespace {

// The variable as a non-negative int; `fallback` when unset or not a number.
int env_int(const char* name, int fallback) {
  const char* s = std::getenv(name);
  if (s == nullptr || *s == '\0') return fallback;
  char* end = nullptr;
  const long v = std::strtol(s, &end, 10);
  if (*end != '\0' || v < 0 || v > (1L << 30)) return fallback;
  return int(v);
}

bool has(const char* name) {
  return std::getenv(name) != nullptr;
}

}  // namespace

int slurm_tasks_on_node(const std::string& list, int node) {
  // Entries "N" or "N(xR)", separated by commas.
  size_t pos = 0;
  int first = 0;
  while (pos < list.size()) {
    size_t used = 0;
    int n = 0, repeat = 1;
    try {
      n = std::stoi(list.substr(pos), &used);
    } catch (...) {
      return 0;
    }
    pos += used;
    if (list.compare(pos, 2, "(x") == 0) {
      try {
        repeat = std::stoi(list.substr(pos + 2), &used);
      } catch (...) {
        return 0;
      }
      pos += 2 + used;
      if (pos >= list.size() || list[pos] != ')') return 0;
      ++pos;
    }
    if (n < 0 || repeat < 1) return 0;
    if (pos < list.size() && list[pos++] != ',') return 0;
    if (node < first + repeat) return node >= first ? n : 0;
    first += repeat;
  }
  return 0;
}

LaunchInfo launch_info() {
  LaunchInfo li;
  if (has("OMPI_COMM_WORLD_SIZE")) {
    li.launcher = "mpirun";
    li.rank = env_int("OMPI_COMM_WORLD_RANK", 0);
    li.world_size = env_int("OMPI_COMM_WORLD_SIZE", 1);
    li.local_rank = env_int("OMPI_COMM_WORLD_LOCAL_RANK", 0);
    li.local_size = env_int("OMPI_COMM_WORLD_LOCAL_SIZE", 1);
    li.mpi_world = true;
  } else if (has("SLURM_STEP_ID") && has("SLURM_PROCID")) {
    li.launcher = "srun";
    li.rank = env_int("SLURM_PROCID", 0);
    li.world_size = env_int("SLURM_STEP_NUM_TASKS", env_int("SLURM_NTASKS", 1));
    li.local_rank = env_int("SLURM_LOCALID", 0);
    const char* per_node = std::getenv("SLURM_STEP_TASKS_PER_NODE");
    const int here = per_node ? slurm_tasks_on_node(per_node, env_int("SLURM_NODEID", 0)) : 0;
    li.local_size = here > 0 ? here : 1;
    // srun --mpi=pmix sets PMIX_RANK, --mpi=pmi2 PMI_RANK; without either MPI_Init cannot find
    // the other tasks.
    li.mpi_world = li.world_size == 1 || has("PMIX_RANK") || has("PMI_RANK");
  } else if (has("PMI_RANK") || has("PMIX_RANK")) {
    li.launcher = "mpirun";
    li.rank = env_int("PMI_RANK", env_int("PMIX_RANK", 0));
    li.world_size = env_int("PMI_SIZE", env_int("PMIX_SIZE", 1));
    li.local_rank = env_int("MPI_LOCALRANKID", 0);
    li.local_size = env_int("MPI_LOCALNRANKS", 1);
    li.mpi_world = true;
  } else if (has("RANK") && has("WORLD_SIZE")) {
    li.launcher = "torchrun";
    li.rank = env_int("RANK", 0);
    li.world_size = env_int("WORLD_SIZE", 1);
    li.local_rank = env_int("LOCAL_RANK", 0);
    li.local_size = env_int("LOCAL_WORLD_SIZE", 1);
    li.mpi_world = li.world_size == 1;
  } else {
    li.mpi_world = true;
  }
  if (li.world_size < 1) li.world_size = 1;
  if (li.local_size < 1) li.local_size = 1;
  return li;
}

}  // namespace zeroshard
