// gtest main for tests run under mpirun: every rank runs every test; only rank 0 prints the
// per-test lines, but any rank's failure fails the process (and so mpirun and ctest).
#include <gtest/gtest.h>

#include "harness.hpp"

namespace zs_test {
static std::shared_ptr<zeroshard::Communicator> g_world;
std::shared_ptr<zeroshard::Communicator> world() {
  return g_world;
}
}  // namespace zs_test

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  zs_test::g_world = zeroshard::make_mpi_communicator();
  if (zs_test::g_world->rank() != 0) {
    // Other ranks report failures only, so the log stays readable.
    auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
    delete listeners.Release(listeners.default_result_printer());
    struct FailurePrinter : ::testing::EmptyTestEventListener {
      void OnTestPartResult(const ::testing::TestPartResult& r) override {
        if (r.failed())
          fprintf(stderr, "[rank %d] %s:%d: %s\n", zs_test::g_world->rank(),
                  r.file_name() ? r.file_name() : "?", r.line_number(), r.summary());
      }
    };
    listeners.Append(new FailurePrinter);
  }
  int rc = RUN_ALL_TESTS();
  // Agree on the outcome so that every rank exits with the same code.
  double failed = rc != 0;
  zs_test::g_world->all_reduce(&failed, 1, zeroshard::ReduceOp::max, "test outcome")->wait();
  zs_test::g_world.reset();
  return failed > 0 ? 1 : 0;
}
