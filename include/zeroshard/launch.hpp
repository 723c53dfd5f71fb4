#pragma once
/// \file launch.hpp
/// How this process was started: its rank, the world's size, and its place on its machine, read
/// from the launcher's environment without starting MPI or anything else.

#include <string>

#include "zeroshard/export.hpp"

namespace zeroshard {

struct LaunchInfo {
  /// "mpirun" (Open MPI's, or an MPICH-style one setting PMI_RANK), "srun" (a Slurm job step),
  /// "torchrun" (RANK/WORLD_SIZE, torch.distributed's launcher), or "none" (one process).
  std::string launcher = "none";
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;  ///< rank among the processes of this machine (the GPU to take)
  int local_size = 1;  ///< processes of this job on this machine (they share its cores)
  /// Whether MPI can join the processes into one world: false under torchrun, and under an srun
  /// that gave them no PMI (then every process would be a world of its own).
  bool mpi_world = false;
};

/// The launcher's variables, first match wins: Open MPI's OMPI_COMM_WORLD_*; a Slurm job step's
/// SLURM_PROCID, SLURM_STEP_NUM_TASKS, SLURM_LOCALID and SLURM_STEP_TASKS_PER_NODE (only in a
/// step, i.e. under srun: a batch script is one process whatever the allocation); MPICH's
/// PMI_RANK, PMI_SIZE, MPI_LOCALRANKID, MPI_LOCALNRANKS; torchrun's RANK, WORLD_SIZE,
/// LOCAL_RANK, LOCAL_WORLD_SIZE. Malformed values are ignored (the defaults stay).
ZS_API LaunchInfo launch_info();

/// Slurm's compressed tasks-per-node list ("2(x3),1": three nodes of 2 tasks, then one of 1):
/// the count of node `node` (0-based), or 0 if the list is malformed or too short.
ZS_API int slurm_tasks_on_node(const std::string& list, int node);

}  // namespace zeroshard
