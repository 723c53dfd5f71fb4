// The NCCL communicator at world size 1 (bootstrapped with make_self_communicator()): every
// collective's result, host staging for all_reduce/broadcast, stream ordering through the input
// stream, timing fields, argument errors, and (NcclTimeout, run as its own ctest entry because
// it aborts NCCL under a blocked stream) the deadline: a collective that cannot finish fails
// with ErrorCode::timeout naming it, and the communicator then refuses further calls.

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <map>
#include <numeric>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "kernels/cpu/cpu_kernels.hpp"
#include "src/comm/nccl/nccl_communicator.hpp"
#include "src/cuda/cuda_resources.hpp"
#include "tests/gpu/gpu_test_util.hpp"
#include "zeroshard/communicator.hpp"
#include "zeroshard/error.hpp"

namespace zeroshard {
namespace {

using zs_gpu_test::DeviceBytes;

class Nccl : public ::testing::Test {
 protected:
  void SetUp() override {
    ZS_REQUIRE_GPU();
    comm_ = make_nccl_communicator(0, make_self_communicator());
    comm_->set_timeout(120);
  }
  std::shared_ptr<Communicator> comm_;
};

TEST_F(Nccl, WorldOfOne) {
  EXPECT_EQ(comm_->rank(), 0);
  EXPECT_EQ(comm_->size(), 1);
}

TEST_F(Nccl, ReduceScatterAndAllGatherAllDtypes) {
  for (DType d : {DType::f32, DType::bf16, DType::f16}) {
    SCOPED_TRACE(dtype_name(d));
    const int64_t n = 1003;
    std::vector<float> v(n);
    std::iota(v.begin(), v.end(), 1.0f);  // small integers: exact in every dtype
    std::vector<unsigned char> bytes(size_t(n) * dtype_size(d));
    cpu::convert(cpu::Isa::scalar, v.data(), DType::f32, bytes.data(), d, n);
    DeviceBytes send(bytes), recv(bytes.size());
    auto w = comm_->reduce_scatter(send.data(), recv.data(), n, d, "unit 'u0'");
    w->wait();
    EXPECT_TRUE(w->done());
    EXPECT_GT(w->started_at(), 0.0);
    EXPECT_GE(w->finished_at(), w->started_at());
    EXPECT_EQ(recv.download<unsigned char>(), bytes);
    // In-place all-gather: this rank's block of recv is the send buffer.
    DeviceBytes gathered(bytes);
    comm_->all_gather(gathered.data(), gathered.data(), n, d, "unit 'u0' (parameters)")->wait();
    EXPECT_EQ(gathered.download<unsigned char>(), bytes);
  }
}

TEST_F(Nccl, AllReduceHostAndDeviceDoubles) {
  double host[2] = {12.5, 1.0};
  comm_->all_reduce(host, 2, ReduceOp::sum, "gradient norm and overflow flag")->wait();
  EXPECT_EQ(host[0], 12.5);
  EXPECT_EQ(host[1], 1.0);
  const std::vector<double> v = {3.0, -4.0, 5.5};
  DeviceBytes dev(v);
  for (ReduceOp op : {ReduceOp::sum, ReduceOp::max, ReduceOp::min})
    comm_->all_reduce(dev.as<double>(), 3, op, "device doubles")->wait();
  EXPECT_EQ(dev.download<double>(), v);
  // Larger than one staging class, to exercise the allocator's big blocks.
  std::vector<double> big(300000, 0.25);
  comm_->all_reduce(big.data(), int64_t(big.size()), ReduceOp::max, "big host array")->wait();
  EXPECT_EQ(big[299999], 0.25);
}

TEST_F(Nccl, BroadcastAndBarrier) {
  std::string text = "rank 0's model description";
  comm_->broadcast(text.data(), int64_t(text.size()), 0, "model check")->wait();
  EXPECT_EQ(text, "rank 0's model description");
  const std::vector<uint8_t> bytes = {1, 2, 3, 4, 5};
  DeviceBytes dev(bytes);
  comm_->broadcast(dev.data(), 5, 0, "device bytes")->wait();
  EXPECT_EQ(dev.download<uint8_t>(), bytes);
  comm_->barrier("after broadcast");
}

// all_to_all (Muon's exchange): at one rank, the rank's own piece by ncclSend/ncclRecv to
// itself, from an offset of the send buffer to another of the recv buffer, the rest of recv
// untouched; a call that moves nothing is done at once.
TEST_F(Nccl, AllToAllMovesTheOwnPieceOnly) {
  const std::vector<float> in = {9, 9, 1, 2, 3, 9};
  DeviceBytes send(in), recv(std::vector<float>(7, -1.0f));
  comm_
      ->all_to_all(send.data(), Pieces{{3}, {2}}, recv.data(), Pieces{{3}, {4}}, DType::f32,
                   "unit 'u0' (Muon round 1 of 1, directions)")
      ->wait();
  EXPECT_EQ(recv.download<float>(), (std::vector<float>{-1, -1, -1, -1, 1, 2, 3}));
  const auto w = comm_->all_to_all(nullptr, Pieces{{0}, {0}}, nullptr, Pieces{{0}, {0}}, DType::f32,
                                   "nothing");
  EXPECT_TRUE(w->done());
  EXPECT_THROW(comm_->all_to_all(send.data(), Pieces{{1, 1}, {0, 0}}, recv.data(), Pieces{{1}, {0}},
                                 DType::f32, "two pieces at one rank"),
               Error);
}

// ncclCommSplit (hierarchical sharding's groups on GPUs), at the one rank a GPU allows: the
// child communicator works, all_reduce_sum of device bf16 included, and the parent goes on.
TEST_F(Nccl, SplitMakesAWorkingChild) {
  auto child = comm_->split({0}, "shard group");
  ASSERT_EQ(child->size(), 1);
  EXPECT_EQ(child->rank(), 0);
  const std::vector<uint16_t> ones(257, 0x3F80);  // bf16 1.0
  DeviceBytes dev(ones);
  child->all_reduce_sum(dev.data(), 257, DType::bf16, "replica all-reduce")->wait();
  EXPECT_EQ(dev.download<uint16_t>(), ones);
  DeviceBytes send(ones), recv(ones.size() * 2);
  child->reduce_scatter(send.data(), recv.data(), 257, DType::bf16, "group reduce-scatter")->wait();
  EXPECT_EQ(recv.download<uint16_t>(), ones);
  comm_->barrier("parent after split");
  EXPECT_THROW(comm_->split({1}, "not this rank's group"), Error);
}

// The store bootstrap (torchrun's path): NCCL's set-up through make_store_communicator().
TEST(NcclStore, BootstrapsThroughAKeyValueStore) {
  ZS_REQUIRE_GPU();
  std::map<std::string, std::string> kv;
  KeyValueStore store;
  store.set = [&](const std::string& k, const std::string& v) { kv[k] = v; };
  store.try_get = [&](const std::string& k) -> std::optional<std::string> {
    auto it = kv.find(k);
    if (it == kv.end()) return std::nullopt;
    return it->second;
  };
  auto comm = make_nccl_communicator(0, make_store_communicator(store, 0, 1));
  EXPECT_EQ(comm->size(), 1);
  double x[2] = {1.5, 0.0};
  comm->all_reduce(x, 2, ReduceOp::sum, "norm")->wait();
  EXPECT_EQ(x[0], 1.5);
  EXPECT_FALSE(kv.empty());  // the set-up went through the store
}

// The input stream orders a collective after work the caller queued without synchronising.
TEST_F(Nccl, WaitsForTheInputStream) {
  auto* nccl = dynamic_cast<NcclCommunicator*>(comm_.get());
  ASSERT_NE(nccl, nullptr);
  cuda::Stream producer(0);
  nccl->set_input_stream(producer.get());
  const int64_t n = 1 << 20;
  std::vector<float> v(n, 3.0f);
  cuda::PinnedBuffer pinned(size_t(n) * 4);
  std::memcpy(pinned.data(), v.data(), size_t(n) * 4);
  DeviceBytes send(size_t(n) * 4), recv(size_t(n) * 4);
  // Hold the producer until the collective has been submitted, then let the copy run.
  std::atomic<bool> go{false};
  ZS_CUDA_CHECK(cudaLaunchHostFunc(
      producer.get(),
      [](void* f) {
        while (!static_cast<std::atomic<bool>*>(f)->load())
          std::this_thread::sleep_for(std::chrono::milliseconds(1));
      },
      &go));
  ZS_CUDA_CHECK(cudaMemcpyAsync(send.data(), pinned.data(), size_t(n) * 4, cudaMemcpyHostToDevice,
                                producer.get()));
  auto w = comm_->reduce_scatter(send.data(), recv.data(), n, DType::f32, "ordered unit");
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  EXPECT_FALSE(w->done()) << "the collective ran before its input was written";
  go.store(true);
  w->wait();
  EXPECT_EQ(recv.download<float>(), v);
  // order_before: a consumer stream sees the result without a host wait.
  cuda::Stream consumer(0);
  nccl->order_before(consumer.get());
  std::vector<float> back(n, 0.0f);
  ZS_CUDA_CHECK(cudaMemcpyAsync(back.data(), recv.data(), size_t(n) * 4, cudaMemcpyDeviceToHost,
                                consumer.get()));
  consumer.synchronize();
  EXPECT_EQ(back, v);
  nccl->set_input_stream(nullptr);
}

TEST_F(Nccl, RejectsHostBuffersForShardedCollectives) {
  std::vector<float> host(16, 1.0f);
  DeviceBytes dev(size_t(64));
  try {
    comm_->reduce_scatter(host.data(), dev.data(), 16, DType::f32, "unit 'bad'");
    FAIL() << "a host send buffer was accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::invalid_argument);
    EXPECT_NE(std::string(e.what()).find("reduce_scatter of unit 'bad'"), std::string::npos)
        << e.what();
    EXPECT_NE(std::string(e.what()).find("not device memory"), std::string::npos) << e.what();
  }
  EXPECT_THROW(comm_->broadcast(host.data(), 4, 1, "bad root"), Error);
}

// Separate ctest entry (gpu.nccl_timeout): the collective waits behind a host function that
// the test releases only after the deadline passed.
TEST(NcclTimeout, FailsNamingTheCollectiveAndPoisons) {
  ZS_REQUIRE_GPU();
  auto comm = make_nccl_communicator(0, make_self_communicator());
  auto* nccl = dynamic_cast<NcclCommunicator*>(comm.get());
  ASSERT_NE(nccl, nullptr);
  comm->set_timeout(0.5);
  cuda::Stream blocked(0);
  nccl->set_input_stream(blocked.get());
  std::atomic<bool> go{false};
  ZS_CUDA_CHECK(cudaLaunchHostFunc(
      blocked.get(),
      [](void* f) {
        while (!static_cast<std::atomic<bool>*>(f)->load())
          std::this_thread::sleep_for(std::chrono::milliseconds(1));
      },
      &go));
  double x[2] = {1, 0};
  auto w = comm->all_reduce(x, 2, ReduceOp::sum, "timeout probe");
  const auto t0 = std::chrono::steady_clock::now();
  try {
    w->wait();
    FAIL() << "a collective behind a blocked stream completed";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::timeout) << e.what();
    EXPECT_NE(std::string(e.what()).find("all_reduce of timeout probe"), std::string::npos)
        << e.what();
    EXPECT_NE(std::string(e.what()).find("did not complete within"), std::string::npos) << e.what();
  }
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(30));
  go.store(true);
  EXPECT_TRUE(w->wait_settled(60.0)) << "the aborted collective never settled";
  try {
    comm->all_reduce(x, 2, ReduceOp::sum, "after the timeout")->wait();
    FAIL() << "a poisoned communicator accepted a collective";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::comm_failure) << e.what();
    EXPECT_NE(std::string(e.what()).find("refused"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace zeroshard
