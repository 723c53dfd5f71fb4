// The launcher's view (launch_info(), read from its environment before MPI starts) agrees with
// the MPI world it started, whichever launcher it was (mpirun, srun): the rank, the world size,
// and the ranks sharing each machine, which pick their GPUs and split the cores by it.

#include <unistd.h>

#include <functional>
#include <string>
#include <vector>

#include "tests/multirank/harness.hpp"

namespace {

using zeroshard::ReduceOp;

TEST(LaunchWorld, LauncherAgreesWithMpi) {
  auto comm = zs_test::world();
  const zeroshard::LaunchInfo li = zeroshard::launch_info();
  const int rank = comm->rank(), world = comm->size();
  EXPECT_EQ(li.rank, rank);
  EXPECT_EQ(li.world_size, world);
  EXPECT_TRUE(li.mpi_world);
  if (world > 1) {
    EXPECT_NE(li.launcher, "none");
  }
  // Every rank's host (a hash of its name), local rank and local size.
  char host[256] = {};
  gethostname(host, sizeof host - 1);
  const double h = double(std::hash<std::string>{}(host) % (1u << 30));
  std::vector<double> all(size_t(world) * 3, 0.0);
  all[size_t(rank) * 3] = h;
  all[size_t(rank) * 3 + 1] = li.local_rank;
  all[size_t(rank) * 3 + 2] = li.local_size;
  comm->all_reduce(all.data(), int64_t(all.size()), ReduceOp::sum, "launch info")->wait();
  // On this rank's host: as many ranks as its local size, with local ranks 0..size-1 once each.
  std::vector<int> seen(size_t(li.local_size), 0);
  int here = 0;
  for (int r = 0; r < world; ++r) {
    if (all[size_t(r) * 3] != h) continue;
    ++here;
    EXPECT_EQ(all[size_t(r) * 3 + 2], li.local_size) << "rank " << r;
    const int lr = int(all[size_t(r) * 3 + 1]);
    ASSERT_TRUE(lr >= 0 && lr < li.local_size) << "rank " << r << " local rank " << lr;
    ++seen[size_t(lr)];
  }
  EXPECT_EQ(here, li.local_size);
  for (int n : seen) EXPECT_EQ(n, 1);
}

}  // namespace
