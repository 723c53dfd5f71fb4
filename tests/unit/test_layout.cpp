// Layout: padding for any world size, shard extents, and group runs cut at shard boundaries.
#include <gtest/gtest.h>

#include "base/layout.hpp"

using namespace zeroshard;

TEST(Layout, PadsToWorldTimesAlignment) {
  for (int world : {1, 2, 3, 5, 7}) {
    UnitLayout u = plan_unit("u", {Param{"w", {10, 3}}, Param{"b", {3}}}, world, 4);
    EXPECT_EQ(u.numel, 33);
    EXPECT_EQ(u.padded_numel % (world * 4), 0);
    EXPECT_GE(u.padded_numel, 33);
    EXPECT_LT(u.padded_numel, 33 + world * 4);
    EXPECT_EQ(u.shard_numel * world, u.padded_numel);
    EXPECT_EQ(u.params[1].offset, 30);
  }
  EXPECT_EQ(plan_unit("e", {}, 3, 4).padded_numel, 12)
      << "an empty unit still has one block per rank";
}

TEST(Layout, RunsMergeGroupsAndStopAtShardEdges) {
  // w (group 0) 0..30, b (group 1) 30..33, g (group 1) 33..36, padding after 36.
  UnitLayout u =
      plan_unit("u", {Param{"w", {10, 3}, 0}, Param{"b", {3}, 1}, Param{"g", {3}, 1}}, 2, 10);
  ASSERT_EQ(u.padded_numel, 40);
  auto all = u.runs(0, 40);
  ASSERT_EQ(all.size(), 2u);
  EXPECT_EQ(all[0].begin, 0);
  EXPECT_EQ(all[0].end, 30);
  EXPECT_EQ(all[1].begin, 30);
  EXPECT_EQ(all[1].end, 36);
  EXPECT_EQ(all[1].group, 1);
  auto second = u.runs(20, 40);  // rank 1's shard: relative offsets
  ASSERT_EQ(second.size(), 2u);
  EXPECT_EQ(second[0].begin, 0);
  EXPECT_EQ(second[0].end, 10);
  EXPECT_EQ(second[1].begin, 10);
  EXPECT_EQ(second[1].end, 16);
}
