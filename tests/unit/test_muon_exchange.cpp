// muon_rounds() (src/muon_exchange.hpp), the plan of Muon's exchange that the engine runs and
// the planner times: on layouts of matrices cut by shards at every offset, each rank holds at
// most one matrix per round, each matrix is orthogonalised once, its owner receives each of
// its elements exactly once from the rank that holds it, and every holder gets its piece back.
#include <gtest/gtest.h>

#include <map>
#include <random>
#include <vector>

#include "src/muon_exchange.hpp"

using namespace zeroshard;

namespace {

// A matrix of `numel` elements at `offset`, orthogonalised by `owner` (a row: only its place and
// size matter to the rounds).
MuonMatrix mat(int64_t offset, int64_t numel, int owner) {
  return MuonMatrix{.offset = offset, .rows = 1, .cols = numel, .owner = owner};
}

// Checks the rounds of `mats` against the definition; returns the elements crossing ranks.
int64_t check(const std::vector<MuonMatrix>& mats, int ranks, int64_t shard) {
  const std::vector<MuonRound> rounds = muon_rounds(mats, ranks, shard);
  std::vector<int> done(mats.size(), 0);
  int64_t crossing = 0;
  for (const MuonRound& round : rounds) {
    EXPECT_EQ(round.matrix.size(), size_t(ranks));
    std::map<int, std::vector<int>> gathered, returned;  // element → from, element → to
    for (int o = 0; o < ranks; ++o) {
      const int i = round.matrix[size_t(o)];
      if (i < 0) continue;
      EXPECT_EQ(mats[size_t(i)].owner, o);
      ++done[size_t(i)];
    }
    for (const MuonTransfer& t : round.gather) {
      const int i = round.matrix[size_t(t.to)];
      EXPECT_GE(i, 0) << "a piece gathered by a rank with no matrix this round";
      if (i < 0) continue;
      const MuonMatrix& m = mats[size_t(i)];
      EXPECT_TRUE(t.offset >= m.offset && t.offset + t.count <= m.offset + m.numel());
      EXPECT_TRUE(t.offset >= t.from * shard && t.offset + t.count <= (t.from + 1) * shard)
          << "rank " << t.from << " sends what it does not hold";
      for (int64_t e = t.offset; e < t.offset + t.count; ++e) gathered[int(e)].push_back(t.from);
      crossing += t.from != t.to ? t.count : 0;
    }
    for (const MuonTransfer& t : round.scatter) {
      const int i = round.matrix[size_t(t.from)];
      EXPECT_GE(i, 0);
      if (i < 0) continue;
      const MuonMatrix& m = mats[size_t(i)];
      EXPECT_TRUE(t.offset >= m.offset && t.offset + t.count <= m.offset + m.numel());
      for (int64_t e = t.offset; e < t.offset + t.count; ++e) returned[int(e)].push_back(t.to);
      crossing += t.from != t.to ? t.count : 0;
    }
    for (int o = 0; o < ranks; ++o) {
      const int i = round.matrix[size_t(o)];
      if (i < 0) continue;
      const MuonMatrix& m = mats[size_t(i)];
      for (int64_t e = m.offset; e < m.offset + m.numel(); ++e) {
        const int holder = shard == 0 ? -1 : int(e / shard);
        if (shard == 0) {  // the owner has it; every rank gets it back
          EXPECT_EQ(gathered.count(int(e)), 0u);
          EXPECT_EQ(returned[int(e)].size(), size_t(ranks)) << "element " << e;
        } else {
          EXPECT_EQ(gathered[int(e)], std::vector<int>{holder}) << "element " << e;
          EXPECT_EQ(returned[int(e)], std::vector<int>{holder}) << "element " << e;
        }
      }
    }
  }
  for (size_t i = 0; i < mats.size(); ++i)
    EXPECT_EQ(done[i], 1) << "matrix " << i << " orthogonalised " << done[i] << " times";
  return crossing;
}

TEST(MuonExchange, EachMatrixOnceOneAtATimeEveryElementToItsOwnerAndBack) {
  std::mt19937 rng(7);
  for (int trial = 0; trial < 300; ++trial) {
    const int ranks = 1 + int(rng() % 5);
    std::vector<MuonMatrix> mats;
    int64_t at = 0;
    const int count = 1 + int(rng() % 7);
    for (int i = 0; i < count; ++i) {
      at += int64_t(rng() % 4);  // vectors and padding between matrices
      const int64_t numel = 1 + int64_t(rng() % 40);
      mats.push_back(mat(at, numel, int(rng() % unsigned(ranks))));
      at += numel;
    }
    const int64_t shard = (at + ranks - 1) / ranks;
    SCOPED_TRACE("trial " + std::to_string(trial) + ", " + std::to_string(ranks) + " ranks");
    check(mats, ranks, shard);
    check(mats, ranks, 0);
  }
}

// Only what its owner does not hold crosses between ranks, twice: a matrix within its owner's
// shard moves nothing, one split over two ranks moves the other rank's part out and back.
TEST(MuonExchange, OnlyPiecesAwayFromTheirOwnerCross) {
  EXPECT_EQ(check({mat(0, 10, 0), mat(10, 10, 1)}, 2, 10), 0);
  EXPECT_EQ(check({mat(5, 10, 0)}, 2, 10), 2 * 5);
  EXPECT_EQ(check({mat(5, 10, 1)}, 2, 10), 2 * 5);
  // Three matrices on rank 0: three rounds, one matrix whole at a time.
  EXPECT_EQ(muon_rounds({mat(0, 4, 0), mat(4, 4, 0), mat(8, 4, 0)}, 2, 6).size(), 3u);
  // Stage 0: every other rank receives each result.
  EXPECT_EQ(check({mat(0, 6, 1)}, 3, 0), 2 * 6);
}

}  // namespace
