// gtest main for tests run under mpirun: every rank runs every test; only rank 0 prints the
// per-test lines, but any rank's failure fails the process (and so mpirun and ctest).
#include <gtest/gtest.h>
#include <unistd.h>

#include "tests/multirank/harness.hpp"
#include "tests/multirank/run_ranks.hpp"

namespace zs_test {
static std::shared_ptr<zeroshard::Communicator> g_world;
std::shared_ptr<zeroshard::Communicator> world() {
  return g_world;
}

std::filesystem::path shared_dir(const std::string& name) {
  double id = world()->rank() == 0 ? double(::getpid()) : 0;
  world()->all_reduce(&id, 1, zeroshard::ReduceOp::max, "test directory")->wait();
  const std::filesystem::path p = std::filesystem::temp_directory_path() /
                                  ("zeroshard-" + name + "-" + std::to_string(int64_t(id)));
  world()->barrier("test directory named");
  if (world()->rank() == 0) std::filesystem::remove_all(p);
  world()->barrier("test directory clean");
  return p;
}
}  // namespace zs_test

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
#ifdef ZS_TEST_ONE_RANK  // a build without MPI: the same tests on one rank
  zs_test::g_world = zeroshard::make_self_communicator();
#else
  zs_test::g_world = zeroshard::make_mpi_communicator();
#endif
  const int rc = zs_test::run_on_all_ranks(*zs_test::g_world);
  zs_test::g_world.reset();
  return rc;
}
