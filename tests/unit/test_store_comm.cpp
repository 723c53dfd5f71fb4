// make_store_communicator(): collectives through a key-value store (what bootstraps NCCL under
// torchrun), here an in-memory store shared by threads standing in for ranks. Every collective
// against its definition, splits, the store kept small, and a missing rank named on timeout.

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstring>
#include <functional>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "tests/unit/all_to_all_case.hpp"
#include "zeroshard/communicator.hpp"
#include "zeroshard/device.hpp"
#include "zeroshard/error.hpp"

namespace {

using zeroshard::Communicator;
using zeroshard::DType;
using zeroshard::ErrorCode;
using zeroshard::ReduceOp;

struct MemoryStore {
  std::mutex mu;
  std::map<std::string, std::string> kv;

  zeroshard::KeyValueStore handle() {
    zeroshard::KeyValueStore s;
    s.set = [this](const std::string& k, const std::string& v) {
      std::lock_guard<std::mutex> l(mu);
      kv[k] = v;
    };
    s.try_get = [this](const std::string& k) -> std::optional<std::string> {
      std::lock_guard<std::mutex> l(mu);
      auto it = kv.find(k);
      if (it == kv.end()) return std::nullopt;
      return it->second;
    };
    s.erase = [this](const std::string& k) {
      std::lock_guard<std::mutex> l(mu);
      kv.erase(k);
    };
    return s;
  }
  size_t size() {
    std::lock_guard<std::mutex> l(mu);
    return kv.size();
  }
};

// Runs body(comm) on `n` threads, one communicator each; rethrows nothing (tests check inside).
void on_ranks(MemoryStore& store, int n, const std::function<void(Communicator&)>& body) {
  std::vector<std::thread> ts;
  for (int r = 0; r < n; ++r)
    ts.emplace_back([&, r] {
      auto c = zeroshard::make_store_communicator(store.handle(), r, n);
      body(*c);
    });
  for (auto& t : ts) t.join();
}

TEST(StoreComm, CollectivesMatchTheirDefinitions) {
  MemoryStore store;
  const int n = 3;
  on_ranks(store, n, [&](Communicator& c) {
    const int r = c.rank();
    EXPECT_EQ(c.size(), n);
    double v[3] = {double(r + 1), double(10 * r), -double(r)};
    double mx[3] = {double(r), double(-r), 0.5};
    double mn[3] = {double(r), double(-r), 0.5};
    c.all_reduce(v, 3, ReduceOp::sum, "sum")->wait();
    c.all_reduce(mx, 3, ReduceOp::max, "max")->wait();
    c.all_reduce(mn, 3, ReduceOp::min, "min")->wait();
    EXPECT_EQ(v[0], 6.0);
    EXPECT_EQ(v[1], 30.0);
    EXPECT_EQ(v[2], -3.0);
    EXPECT_EQ(mx[0], 2.0);
    EXPECT_EQ(mx[1], 0.0);
    EXPECT_EQ(mn[0], 0.0);
    EXPECT_EQ(mn[1], -2.0);
    EXPECT_EQ(mn[2], 0.5);

    // reduce_scatter: rank r's block is the sum of every rank's block r.
    std::vector<float> send(size_t(n) * 4);
    for (size_t i = 0; i < send.size(); ++i) send[i] = float(i) + 0.25f * float(r);
    std::vector<float> recv(4, -1.0f);
    c.reduce_scatter(send.data(), recv.data(), 4, DType::f32, "rs")->wait();
    for (int i = 0; i < 4; ++i)
      EXPECT_EQ(recv[size_t(i)], 3.0f * float(r * 4 + i) + 0.25f * 3.0f) << i;

    // all_gather, in place as the engine calls it.
    std::vector<float> all(size_t(n) * 2, 0.0f);
    all[size_t(r) * 2] = float(r);
    all[size_t(r) * 2 + 1] = float(100 + r);
    c.all_gather(all.data() + r * 2, all.data(), 2, DType::f32, "ag")->wait();
    for (int k = 0; k < n; ++k) {
      EXPECT_EQ(all[size_t(k) * 2], float(k));
      EXPECT_EQ(all[size_t(k) * 2 + 1], float(100 + k));
    }

    // all_reduce_sum of bf16 (1.0 = 0x3F80): the same bits everywhere.
    uint16_t h[2] = {0x3F80, uint16_t(r == 0 ? 0x4000 : 0x0000)};
    c.all_reduce_sum(h, 2, DType::bf16, "bf16 sum")->wait();
    EXPECT_EQ(h[0], 0x4040);  // 3.0
    EXPECT_EQ(h[1], 0x4000);  // 2.0

    // broadcast of raw bytes from rank 1 (zeros included).
    unsigned char blob[5] = {0, 0, 0, 0, 0};
    if (r == 1) std::memcpy(blob, "\x00\x7f\xff\x10\x01", 5);
    c.broadcast(blob, 5, 1, "blob")->wait();
    EXPECT_EQ(0, std::memcmp(blob, "\x00\x7f\xff\x10\x01", 5));
    c.barrier("end");
  });
  // Each rank's earlier rounds were erased: one key per rank is left.
  EXPECT_EQ(store.size(), size_t(n));
}

TEST(StoreComm, AllToAllMovesEachPieceToItsRank) {
  for (int n : {1, 2, 3}) {
    MemoryStore store;
    on_ranks(store, n, [](Communicator& c) { zs_test::check_all_to_all(c); });
  }
}

TEST(StoreComm, SplitGroupsTalkAmongThemselves) {
  MemoryStore store;
  on_ranks(store, 4, [&](Communicator& c) {
    const int r = c.rank();
    const std::vector<int> group = r % 2 == 0 ? std::vector<int>{0, 2} : std::vector<int>{1, 3};
    auto g = c.split(group, "pairs");
    EXPECT_EQ(g->size(), 2);
    EXPECT_EQ(g->rank(), r / 2);
    double v = r;
    g->all_reduce(&v, 1, ReduceOp::sum, "pair sum")->wait();
    EXPECT_EQ(v, r % 2 == 0 ? 2.0 : 4.0);
    // The parent goes on independently.
    double w = 1;
    c.all_reduce(&w, 1, ReduceOp::sum, "world sum")->wait();
    EXPECT_EQ(w, 4.0);
  });
}

TEST(StoreComm, AMissingRankIsNamedOnTimeout) {
  MemoryStore store;
  auto c = zeroshard::make_store_communicator(store.handle(), 0, 3);
  // Rank 1 publishes its round, rank 2 never comes.
  store.handle().set("zeroshard/0/1", "0000000000000000");
  c->set_timeout(0.2);
  double v = 1;
  try {
    c->all_reduce(&v, 1, ReduceOp::sum, "the step's norm")->wait();
    ADD_FAILURE() << "no timeout";
  } catch (const zeroshard::Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::timeout);
    EXPECT_THAT(e.what(), testing::HasSubstr("the step's norm"));
    EXPECT_THAT(e.what(), testing::HasSubstr("rank 2"));
  }
  // Out of step with its peers now: later calls fail at once.
  try {
    c->barrier("later");
    ADD_FAILURE() << "no failure";
  } catch (const zeroshard::Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::comm_failure);
  }
}

TEST(StoreComm, DifferentCollectivesOnRanksFailByName) {
  MemoryStore store;
  std::vector<std::string> errors(2);
  on_ranks(store, 2, [&](Communicator& c) {
    double v[2] = {1, 2};
    try {
      c.all_reduce(v, c.rank() == 0 ? 1 : 2, ReduceOp::sum, "mismatch")->wait();
    } catch (const zeroshard::Error& e) {
      errors[size_t(c.rank())] = e.what();
    }
  });
  for (const auto& e : errors) EXPECT_THAT(e, testing::HasSubstr("called different collectives"));
}

TEST(StoreComm, RefusesBadArguments) {
  MemoryStore store;
  EXPECT_THROW(zeroshard::make_store_communicator(store.handle(), 2, 2), zeroshard::Error);
  EXPECT_THROW(zeroshard::make_store_communicator({}, 0, 1), zeroshard::Error);
  auto c = zeroshard::make_store_communicator(store.handle(), 0, 1);
  char b = 0;
  EXPECT_THROW(c->broadcast(&b, 1, 1, "root out of range"), zeroshard::Error);
}

TEST(StoreComm, BootstrapsNcclSetUpOnEveryRank) {
  // make_nccl_communicator() over the store: its device check is a collective through the
  // store, so on a machine without a GPU every rank reports its own missing device (instead of
  // one rank failing and the other waiting). On a GPU machine tests/gpu covers the rest.
  std::string why;
  if (zeroshard::cuda_device_count(&why) > 0) GTEST_SKIP() << "a GPU is present: tests/gpu";
  MemoryStore store;
  std::vector<std::string> errors(2);
  on_ranks(store, 2, [&](Communicator& c) {
    auto boot = std::shared_ptr<Communicator>(&c, [](Communicator*) {});
    try {
      zeroshard::make_nccl_communicator(c.rank(), boot);
    } catch (const zeroshard::Error& e) {
      errors[size_t(c.rank())] = e.what();
    }
  });
  for (const auto& e : errors) EXPECT_THAT(e, testing::HasSubstr("CUDA"));
#ifdef ZEROSHARD_HAVE_CUDA
  // Built with CUDA: the ranks got as far as the device check, which went through the store.
  for (const auto& e : errors) EXPECT_THAT(e, testing::HasSubstr("no CUDA device"));
  EXPECT_GT(store.size(), 0u);
#endif
}

}  // namespace
