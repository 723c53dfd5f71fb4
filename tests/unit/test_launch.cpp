// launch_info(): each launcher's variables give the rank, world and place on the machine, the
// first launcher present wins, and a launch MPI cannot join is recognised before MPI starts.

#include <gtest/gtest.h>

#include <cstdlib>
#include <map>
#include <string>

#include "zeroshard/launch.hpp"

namespace {

const char* const kVars[] = {"OMPI_COMM_WORLD_RANK",
                             "OMPI_COMM_WORLD_SIZE",
                             "OMPI_COMM_WORLD_LOCAL_RANK",
                             "OMPI_COMM_WORLD_LOCAL_SIZE",
                             "SLURM_STEP_ID",
                             "SLURM_PROCID",
                             "SLURM_STEP_NUM_TASKS",
                             "SLURM_NTASKS",
                             "SLURM_LOCALID",
                             "SLURM_STEP_TASKS_PER_NODE",
                             "SLURM_NODEID",
                             "PMIX_RANK",
                             "PMIX_SIZE",
                             "PMI_RANK",
                             "PMI_SIZE",
                             "MPI_LOCALRANKID",
                             "MPI_LOCALNRANKS",
                             "RANK",
                             "WORLD_SIZE",
                             "LOCAL_RANK",
                             "LOCAL_WORLD_SIZE"};

// Sets exactly `vars` among the launchers' variables for the test's lifetime.
class Env {
 public:
  explicit Env(const std::map<std::string, std::string>& vars) {
    for (const char* v : kVars) {
      if (const char* s = std::getenv(v)) saved_[v] = s;
      unsetenv(v);
    }
    for (const auto& [k, v] : vars) setenv(k.c_str(), v.c_str(), 1);
  }
  ~Env() {
    for (const char* v : kVars) unsetenv(v);
    for (const auto& [k, v] : saved_) setenv(k.c_str(), v.c_str(), 1);
  }

 private:
  std::map<std::string, std::string> saved_;
};

using zeroshard::launch_info;
using zeroshard::slurm_tasks_on_node;

TEST(Launch, NoLauncherIsOneProcess) {
  Env env({});
  const auto li = launch_info();
  EXPECT_EQ(li.launcher, "none");
  EXPECT_EQ(li.rank, 0);
  EXPECT_EQ(li.world_size, 1);
  EXPECT_EQ(li.local_size, 1);
  EXPECT_TRUE(li.mpi_world);
}

TEST(Launch, OpenMpi) {
  Env env({{"OMPI_COMM_WORLD_RANK", "5"},
           {"OMPI_COMM_WORLD_SIZE", "8"},
           {"OMPI_COMM_WORLD_LOCAL_RANK", "1"},
           {"OMPI_COMM_WORLD_LOCAL_SIZE", "4"},
           // mpirun inside a Slurm step (its daemons were started by srun): Open MPI's own
           // variables describe the ranks, Slurm's the daemons.
           {"SLURM_STEP_ID", "0"},
           {"SLURM_PROCID", "1"},
           {"SLURM_STEP_NUM_TASKS", "2"}});
  const auto li = launch_info();
  EXPECT_EQ(li.launcher, "mpirun");
  EXPECT_EQ(li.rank, 5);
  EXPECT_EQ(li.world_size, 8);
  EXPECT_EQ(li.local_rank, 1);
  EXPECT_EQ(li.local_size, 4);
  EXPECT_TRUE(li.mpi_world);
}

TEST(Launch, SrunStepWithPmix) {
  Env env({{"SLURM_STEP_ID", "0"},
           {"SLURM_PROCID", "6"},
           {"SLURM_STEP_NUM_TASKS", "7"},
           {"SLURM_NTASKS", "99"},
           {"SLURM_LOCALID", "0"},
           {"SLURM_NODEID", "3"},
           {"SLURM_STEP_TASKS_PER_NODE", "2(x3),1"},
           {"PMIX_RANK", "6"}});
  const auto li = launch_info();
  EXPECT_EQ(li.launcher, "srun");
  EXPECT_EQ(li.rank, 6);
  EXPECT_EQ(li.world_size, 7);  // the step's tasks, not the allocation's
  EXPECT_EQ(li.local_rank, 0);
  EXPECT_EQ(li.local_size, 1);  // node 3 is the one of 1 task
  EXPECT_TRUE(li.mpi_world);
}

TEST(Launch, SrunWithoutPmiCannotMakeOneMpiWorld) {
  Env env({{"SLURM_STEP_ID", "0"},
           {"SLURM_PROCID", "1"},
           {"SLURM_STEP_NUM_TASKS", "2"},
           {"SLURM_LOCALID", "1"},
           {"SLURM_NODEID", "0"},
           {"SLURM_STEP_TASKS_PER_NODE", "2"}});
  const auto li = launch_info();
  EXPECT_EQ(li.launcher, "srun");
  EXPECT_EQ(li.local_size, 2);
  EXPECT_FALSE(li.mpi_world);
}

TEST(Launch, BatchScriptIsOneProcessWhateverTheAllocation) {
  // sbatch -n 2 runs its script once, with SLURM_NTASKS=2 and SLURM_PROCID=0 but no step.
  Env env({{"SLURM_NTASKS", "2"}, {"SLURM_PROCID", "0"}, {"SLURM_LOCALID", "0"}});
  const auto li = launch_info();
  EXPECT_EQ(li.launcher, "none");
  EXPECT_EQ(li.world_size, 1);
  EXPECT_TRUE(li.mpi_world);
}

TEST(Launch, MpichHydra) {
  Env env(
      {{"PMI_RANK", "2"}, {"PMI_SIZE", "3"}, {"MPI_LOCALRANKID", "0"}, {"MPI_LOCALNRANKS", "1"}});
  const auto li = launch_info();
  EXPECT_EQ(li.launcher, "mpirun");
  EXPECT_EQ(li.rank, 2);
  EXPECT_EQ(li.world_size, 3);
  EXPECT_TRUE(li.mpi_world);
}

TEST(Launch, Torchrun) {
  Env env({{"RANK", "3"}, {"WORLD_SIZE", "4"}, {"LOCAL_RANK", "1"}, {"LOCAL_WORLD_SIZE", "2"}});
  const auto li = launch_info();
  EXPECT_EQ(li.launcher, "torchrun");
  EXPECT_EQ(li.rank, 3);
  EXPECT_EQ(li.world_size, 4);
  EXPECT_EQ(li.local_rank, 1);
  EXPECT_EQ(li.local_size, 2);
  EXPECT_FALSE(li.mpi_world);
  Env one({{"RANK", "0"}, {"WORLD_SIZE", "1"}});
  EXPECT_TRUE(launch_info().mpi_world);
}

TEST(Launch, MalformedValuesKeepTheDefaults) {
  Env env({{"OMPI_COMM_WORLD_SIZE", "four"},
           {"OMPI_COMM_WORLD_RANK", "-1"},
           {"OMPI_COMM_WORLD_LOCAL_SIZE", "0"}});
  const auto li = launch_info();
  EXPECT_EQ(li.world_size, 1);
  EXPECT_EQ(li.rank, 0);
  EXPECT_EQ(li.local_size, 1);
}

TEST(Launch, SlurmTasksPerNodeList) {
  EXPECT_EQ(slurm_tasks_on_node("4", 0), 4);
  EXPECT_EQ(slurm_tasks_on_node("4", 1), 0);
  EXPECT_EQ(slurm_tasks_on_node("2(x3),1", 0), 2);
  EXPECT_EQ(slurm_tasks_on_node("2(x3),1", 2), 2);
  EXPECT_EQ(slurm_tasks_on_node("2(x3),1", 3), 1);
  EXPECT_EQ(slurm_tasks_on_node("2(x3),1", 4), 0);
  EXPECT_EQ(slurm_tasks_on_node("1,3(x2)", 2), 3);
  for (const char* bad : {"", "x", "2(x", "2(x3", "2(x0)", "2;3", "2(y3)"})
    EXPECT_EQ(slurm_tasks_on_node(bad, 0), 0) << bad;
}

}  // namespace
