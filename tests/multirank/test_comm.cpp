// The MPI communicator on its own: results of every collective against values computed here,
// for sizes that do not divide evenly, every dtype, in-place gathers, and a timeout.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <limits>
#include <thread>

#include "tests/multirank/harness.hpp"
#include "tests/unit/all_to_all_case.hpp"

using namespace zeroshard;
using zs_test::world;

namespace {

TEST(Comm, ReduceScatterSumsEveryDtype) {
  auto c = world();
  const int n = c->size(), r = c->rank();
  for (DType dt : {DType::f32, DType::bf16, DType::f16}) {
    for (int64_t count : {1, 7, 1000}) {
      size_t es = dtype_size(dt);
      std::vector<char> send(size_t(count * n) * es), recv(size_t(count) * es, 0x55);
      // Small integers are exact in every dtype, so the expected sum is exact too.
      for (int64_t i = 0; i < count * n; ++i)
        zs_test::store(send.data(), dt, i, float((i + r) % 17));
      c->reduce_scatter(send.data(), recv.data(), count, dt, "test")->wait();
      for (int64_t i = 0; i < count; ++i) {
        int64_t gi = r * count + i;
        float want = 0;
        for (int q = 0; q < n; ++q) want += float((gi + q) % 17);
        ASSERT_EQ(zs_test::load(recv.data(), dt, i), want)
            << dtype_name(dt) << " count " << count << " i " << i;
      }
    }
  }
}

// all_reduce_sum: every rank gets the same sum, of every dtype; in bf16 one that needs
// rounding too (the ranks' results must still be bitwise equal).
TEST(Comm, AllReduceSumGivesEveryRankTheSameSum) {
  auto c = world();
  const int n = c->size(), r = c->rank();
  for (DType dt : {DType::f32, DType::bf16, DType::f16}) {
    const int64_t count = 1001;
    std::vector<char> buf(size_t(count) * dtype_size(dt));
    for (int64_t i = 0; i < count; ++i) zs_test::store(buf.data(), dt, i, float((i + r) % 13));
    c->all_reduce_sum(buf.data(), count, dt, "test")->wait();
    for (int64_t i = 0; i < count; ++i) {
      float want = 0;
      for (int q = 0; q < n; ++q) want += float((i + q) % 13);
      ASSERT_EQ(zs_test::load(buf.data(), dt, i), want) << dtype_name(dt) << " i " << i;
    }
    for (int64_t i = 0; i < count; ++i)
      zs_test::store(buf.data(), dt, i, 1.0f + float(i * 7 + r * 3) / 1024.0f);
    c->all_reduce_sum(buf.data(), count, dt, "test")->wait();
    c->broadcast(buf.data(), int64_t(buf.size()), 0, "test")->wait();  // rank 0's result ...
    std::vector<char> mine(buf.size());
    for (int64_t i = 0; i < count; ++i)
      zs_test::store(mine.data(), dt, i, 1.0f + float(i * 7 + r * 3) / 1024.0f);
    c->all_reduce_sum(mine.data(), count, dt, "test")->wait();
    EXPECT_EQ(std::memcmp(mine.data(), buf.data(), buf.size()), 0)  // ... is every rank's
        << dtype_name(dt);
  }
}

// split(): groups of consecutive ranks and groups across them, each with its own collectives;
// bad groups are refused before any rank joins.
TEST(Comm, SplitMakesGroupsWithTheirOwnCollectives) {
  auto c = world();
  const int n = c->size(), r = c->rank();
  const int per = n % 2 == 0 ? 2 : 1;
  std::vector<int> mine, across;
  for (int q = r / per * per; q < r / per * per + per; ++q) mine.push_back(q);
  for (int q = r % per; q < n; q += per) across.push_back(q);
  auto g = c->split(mine, "test groups");
  auto x = c->split(across, "test across");
  EXPECT_EQ(g->size(), per);
  EXPECT_EQ(g->rank(), r % per);
  EXPECT_EQ(x->size(), n / per);
  EXPECT_EQ(x->rank(), r / per);
  double v[2] = {double(r), 1.0};
  g->all_reduce(v, 2, ReduceOp::sum, "test")->wait();
  double want = 0;
  for (int q : mine) want += q;
  EXPECT_EQ(v[0], want);
  EXPECT_EQ(v[1], double(per));
  float f = float(r);
  std::vector<float> all(size_t(x->size()));
  x->all_gather(&f, all.data(), 1, DType::f32, "test")->wait();
  for (size_t i = 0; i < all.size(); ++i) EXPECT_EQ(all[i], float(across[i]));
  EXPECT_ZS_ERROR(c->split({r + 1}, "test"), invalid_argument, "this rank among them");
  EXPECT_ZS_ERROR(c->split({r, r}, "test"), invalid_argument, "must be ascending");
}

TEST(Comm, AllGatherInPlaceAndOutOfPlace) {
  auto c = world();
  const int n = c->size(), r = c->rank();
  const int64_t count = 13;
  std::vector<float> mine(count), whole(size_t(count * n), -1.0f),
      inplace(size_t(count * n), -1.0f);
  for (int64_t i = 0; i < count; ++i) mine[size_t(i)] = float(r * 100 + i);
  std::copy(mine.begin(), mine.end(), inplace.begin() + r * count);
  auto w1 = c->all_gather(mine.data(), whole.data(), count, DType::f32, "out of place");
  auto w2 =
      c->all_gather(inplace.data() + r * count, inplace.data(), count, DType::f32, "in place");
  w1->wait();
  w2->wait();
  for (int q = 0; q < n; ++q)
    for (int64_t i = 0; i < count; ++i) {
      ASSERT_EQ(whole[size_t(q * count + i)], float(q * 100 + i));
      ASSERT_EQ(inplace[size_t(q * count + i)], float(q * 100 + i));
    }
}

// all_to_all (Muon's exchange): every piece at its rank and place, gaps untouched, with the
// MPI communicator and the one-rank one; bad pieces are refused before any rank moves.
TEST(Comm, AllToAllMovesEachPieceToItsRank) {
  auto c = world();
  zs_test::check_all_to_all(*c);
  zs_test::check_all_to_all(*make_self_communicator());
  const int n = c->size();
  std::vector<float> buf(8);
  const Pieces few{std::vector<int64_t>(size_t(n + 1), 0), std::vector<int64_t>(size_t(n + 1), 0)};
  const Pieces none{std::vector<int64_t>(size_t(n), 0), std::vector<int64_t>(size_t(n), 0)};
  Pieces negative = none;
  negative.counts[0] = -1;
  EXPECT_ZS_ERROR(c->all_to_all(buf.data(), few, buf.data(), none, DType::f32, "test"),
                  invalid_argument, "pieces give");
  EXPECT_ZS_ERROR(c->all_to_all(buf.data(), none, buf.data(), negative, DType::f32, "test"),
                  invalid_argument, "has count -1");
  // The communicator is still in step: a collective after the refusals completes.
  zs_test::check_all_to_all(*c);
}

TEST(Comm, AllReduceAndBroadcast) {
  auto c = world();
  double v[3] = {double(c->rank() + 1), double(c->rank()), -double(c->rank())};
  c->all_reduce(v, 1, ReduceOp::sum, "sum")->wait();
  c->all_reduce(v + 1, 1, ReduceOp::max, "max")->wait();
  c->all_reduce(v + 2, 1, ReduceOp::min, "min")->wait();
  int n = c->size();
  EXPECT_EQ(v[0], n * (n + 1) / 2.0);
  EXPECT_EQ(v[1], n - 1);
  EXPECT_EQ(v[2], -(n - 1));
  char msg[6] = "....";
  if (c->rank() == n - 1) std::snprintf(msg, sizeof msg, "hello");
  c->broadcast(msg, 6, n - 1, "bcast")->wait();
  EXPECT_STREQ(msg, "hello");
}

TEST(Comm, TimeoutNamesTheCollective) {
  if (world()->size() < 2) GTEST_SKIP() << "needs 2 or more ranks (runs under mpirun -np 2..4)";
  auto c = make_mpi_communicator();
  c->set_timeout(0.3);
  double v = 1;
  if (c->rank() == 0) {
    auto w = c->all_reduce(&v, 1, ReduceOp::sum, "the slow sum");
    try {
      w->wait();
      ADD_FAILURE() << "no timeout";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::timeout);
      EXPECT_NE(std::string(e.what()).find("all_reduce of the slow sum did not complete within"),
                std::string::npos)
          << e.what();
    }
    EXPECT_TRUE(w->wait_settled(30)) << "the late peers complete the abandoned collective";
    EXPECT_EQ(v, c->size());
  } else {
    std::this_thread::sleep_for(std::chrono::milliseconds(1000));
    c->all_reduce(&v, 1, ReduceOp::sum, "the slow sum")->wait();
  }
  world()->barrier("after comm timeout");
}

// Many collectives submitted at once (as stages 0-1 reduce every unit's gradients, and stages
// 1-2 gather every unit's parameters) all complete, each with its own result, however many the
// communicator runs at a time.
TEST(Comm, ManyQueuedCollectivesCompleteEachWithItsResult) {
  auto c = world();
  const int n = c->size(), r = c->rank();
  constexpr int kCalls = 40;
  constexpr int64_t kCount = 1000;
  std::vector<std::vector<float>> send(kCalls), recv(kCalls), gathered(kCalls);
  std::vector<std::shared_ptr<Work>> works;
  for (int k = 0; k < kCalls; ++k) {
    send[size_t(k)].assign(size_t(kCount * n), float(k + r));
    recv[size_t(k)].assign(size_t(kCount), -1.0f);
    gathered[size_t(k)].assign(size_t(kCount * n), -1.0f);
    works.push_back(c->reduce_scatter(send[size_t(k)].data(), recv[size_t(k)].data(), kCount,
                                      DType::f32, "queued " + std::to_string(k)));
  }
  for (const std::shared_ptr<Work>& w : works) w->wait();
  works.clear();
  // Then as many gathers at once, each of one reduction's output.
  for (int k = 0; k < kCalls; ++k)
    works.push_back(c->all_gather(recv[size_t(k)].data(), gathered[size_t(k)].data(), kCount,
                                  DType::f32, "queued gather " + std::to_string(k)));
  for (const std::shared_ptr<Work>& w : works) w->wait();
  for (int k = 0; k < kCalls; ++k) {
    const float want = float(n * k + n * (n - 1) / 2);
    for (float x : gathered[size_t(k)]) ASSERT_EQ(x, want) << "call " << k;
  }
}

// Collectives queued behind one that times out end too: refused at once, not left waiting for
// a turn that never comes. Rank 0 submits five while the others are late; every one must end
// within a few timeouts. The others then call the ones rank 0 started (which time out rather
// than being refused), so that no request stays unmatched.
TEST(Comm, CollectivesQueuedBehindATimeoutAreRefused) {
  if (world()->size() < 2) GTEST_SKIP() << "needs 2 or more ranks (runs under mpirun -np 2..4)";
  auto c = make_mpi_communicator();
  c->set_timeout(0.3);
  constexpr int kCalls = 5;
  double v[kCalls];
  std::fill_n(v, kCalls, 1.0);
  int started = 0;
  if (c->rank() == 0) {
    std::vector<std::shared_ptr<Work>> works;
    for (int k = 0; k < kCalls; ++k)
      works.push_back(c->all_reduce(v + k, 1, ReduceOp::sum, "late sum " + std::to_string(k)));
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    for (int k = 0; k < kCalls; ++k) {
      while (!works[size_t(k)]->done() && std::chrono::steady_clock::now() < until)
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
      if (!works[size_t(k)]->done()) {  // still meet the others below, rather than hang them
        ADD_FAILURE() << "call " << k << " did not end within 10 s";
        continue;
      }
      try {
        works[size_t(k)]->wait();
        ADD_FAILURE() << "call " << k << " completed without its peers";
      } catch (const Error& e) {
        const std::string m = e.what();
        if (e.code() == ErrorCode::timeout) {
          EXPECT_EQ(started, k) << "a timed-out call after a refused one: " << m;
          ++started;
        } else {
          EXPECT_NE(m.find("refused: the communicator is unusable"), std::string::npos) << m;
        }
      }
    }
    EXPECT_GE(started, 1);
  }
  double n_started = started;
  world()->all_reduce(&n_started, 1, ReduceOp::max, "calls rank 0 started")->wait();
  if (c->rank() != 0)
    for (int k = 0; k < int(n_started); ++k)
      c->all_reduce(v + k, 1, ReduceOp::sum, "late sum " + std::to_string(k))->wait();
  world()->barrier("after queued timeouts");
}

// "Never time out" written as a huge number is a deadline far ahead, not one that overflowed
// into the past and failed every collective at once (it did, from 1e10 s up).
TEST(Comm, HugeTimeoutMeansNoTimeout) {
  auto c = make_mpi_communicator();
  for (double t : {1e10, 1e300, std::numeric_limits<double>::infinity()}) {
    c->set_timeout(t);
    double v = 1;
    if (c->rank() == 0) std::this_thread::sleep_for(std::chrono::milliseconds(50));
    EXPECT_NO_THROW(c->all_reduce(&v, 1, ReduceOp::sum, "a sum under a huge timeout")->wait()) << t;
    EXPECT_EQ(v, c->size());
  }
}

}  // namespace

// Checking mode (ZEROSHARD_CHECK_COLLECTIVES=1): ranks that call different collectives get an
// error naming both calls at once, instead of a hang or a timeout; matching calls still work.
TEST(Comm, CheckingModeNamesMismatchedCalls) {
  if (world()->size() < 2) GTEST_SKIP() << "needs 2 or more ranks (runs under mpirun -np 2..4)";
  setenv("ZEROSHARD_CHECK_COLLECTIVES", "1", 1);
  auto c = make_mpi_communicator();
  unsetenv("ZEROSHARD_CHECK_COLLECTIVES");
  c->set_timeout(60);
  double v = 1;
  c->all_reduce(&v, 1, ReduceOp::sum, "matching sum")->wait();
  EXPECT_EQ(v, c->size());
  std::vector<float> buf(8 * size_t(c->size()));
  try {
    if (c->rank() == 1)
      c->all_gather(buf.data() + 8, buf.data(), 8, DType::f32, "unit 'b'")->wait();
    else
      c->all_reduce(&v, 1, ReduceOp::sum, "unit 'a'")->wait();
    ADD_FAILURE() << "mismatched collectives went through";
  } catch (const Error& e) {
    std::string m = e.what();
    EXPECT_EQ(e.code(), ErrorCode::comm_failure);
    EXPECT_NE(m.find("collective mismatch"), std::string::npos) << m;
    EXPECT_NE(m.find(c->rank() == 1 ? "all_gather of unit 'b' (8 f32 per rank)"
                                    : "all_reduce of unit 'a' (1 doubles)"),
              std::string::npos)
        << m;
  }
  world()->barrier("after checking mode");
}
