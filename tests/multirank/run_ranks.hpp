#pragma once
// The end of every multi-rank test main: runs the tests on this rank (rank 0 reports in full,
// the others print only their failures, so the log stays readable), then agrees on the outcome
// so that every rank, and so mpirun and ctest, exits with the same code.

#include <gtest/gtest.h>

#include <cstdio>

#include "zeroshard/communicator.hpp"

namespace zs_test {

inline int run_on_all_ranks(zeroshard::Communicator& comm) {
  if (comm.rank() != 0) {
    auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
    delete listeners.Release(listeners.default_result_printer());
    struct FailurePrinter : ::testing::EmptyTestEventListener {
      explicit FailurePrinter(int r) : rank(r) {}
      void OnTestPartResult(const ::testing::TestPartResult& r) override {
        if (r.failed())
          std::fprintf(stderr, "[rank %d] %s:%d: %s\n", rank, r.file_name() ? r.file_name() : "?",
                       r.line_number(), r.summary());
      }
      int rank;
    };
    listeners.Append(new FailurePrinter(comm.rank()));
  }
  const int rc = RUN_ALL_TESTS();
  double failed = rc != 0;
  comm.all_reduce(&failed, 1, zeroshard::ReduceOp::max, "test outcome")->wait();
  return failed > 0 ? 1 : 0;
}

}  // namespace zs_test
