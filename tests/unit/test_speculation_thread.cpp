// The speculative step's thread (src/tiers/speculation.hpp): jobs run in the order posted, on
// one thread that is not the caller's; settle() returns only once they all ran; the first
// failure is kept for take_failure(); destruction drops the jobs not started.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <stdexcept>
#include <thread>
#include <vector>

#include "src/tiers/speculation.hpp"

using zeroshard::SpeculationThread;

TEST(SpeculationThread, RunsJobsInOrderOffTheCallersThread) {
  SpeculationThread t;
  std::vector<int> order;  // written by the thread only, read after settle()
  std::atomic<bool> elsewhere{true};
  const std::thread::id caller = std::this_thread::get_id();
  for (int i = 0; i < 100; ++i)
    t.post([&, i] {
      if (i % 10 == 0) std::this_thread::sleep_for(std::chrono::microseconds(200));
      if (std::this_thread::get_id() == caller) elsewhere = false;
      order.push_back(i);
    });
  t.settle();
  ASSERT_EQ(order.size(), 100u);
  for (int i = 0; i < 100; ++i) EXPECT_EQ(order[size_t(i)], i);
  EXPECT_TRUE(elsewhere);
  t.settle();  // nothing posted: returns at once
}

// Jobs posted `first` overtake the others not started yet, and settle_first() waits for them
// alone: a gradient's pass ahead of the updates queued before it.
TEST(SpeculationThread, FirstJobsOvertakeAndAreWaitedForAlone) {
  SpeculationThread t;
  std::vector<int> order;  // written by the thread only, read after settle()
  std::atomic<bool> started{false}, release{false};
  std::atomic<int> firsts{0};
  t.post([&] {
    started = true;
    while (!release) std::this_thread::yield();  // holds the thread while the rest is posted
    order.push_back(0);
  });
  while (!started) std::this_thread::yield();
  t.post([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    order.push_back(1);
  });
  t.post([&] { order.push_back(2), ++firsts; }, true);
  t.post([&] { order.push_back(3), ++firsts; }, true);
  release = true;
  t.settle_first();
  EXPECT_EQ(firsts, 2);
  t.settle();
  EXPECT_EQ(order, (std::vector<int>{0, 2, 3, 1}));
}

TEST(SpeculationThread, KeepsTheFirstFailureForWhoeverTakesIt) {
  SpeculationThread t;
  int ran = 0;
  t.post([] { throw std::runtime_error("first"); });
  t.post([] { throw std::runtime_error("second"); });
  t.post([&] { ++ran; });  // a failure does not stop the jobs after it
  EXPECT_NO_THROW(t.settle());
  t.settle();  // a second wait does not take it either
  EXPECT_EQ(ran, 1);
  std::exception_ptr failed = t.take_failure();
  ASSERT_TRUE(failed);
  try {
    std::rethrow_exception(failed);
  } catch (const std::runtime_error& e) {
    EXPECT_STREQ(e.what(), "first");
  }
  EXPECT_FALSE(t.take_failure());
}

TEST(SpeculationThread, DestructionFinishesTheRunningJobAndDropsTheRest) {
  std::atomic<int> ran{0};
  std::atomic<bool> started{false};
  {
    SpeculationThread t;
    for (int i = 0; i < 10; ++i)
      t.post([&] {
        started = true;
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
        ++ran;
      });
    while (!started) std::this_thread::yield();
  }
  EXPECT_GE(ran, 1);
  EXPECT_LT(ran, 10);
}
