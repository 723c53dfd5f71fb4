// The MPI communicator with device buffers, under mpirun with every rank on device 0 (several
// ranks sharing one GPU, which NCCL refuses): stage_device_buffers(make_mpi_communicator())
// stages CUDA device memory through pinned host memory. Results are compared exactly: the inputs
// are small integers, exact in f32 and bf16 and in every sum. Device buffers are poisoned
// before each call, so a collective that did not copy its result back fails.
// Without a GPU every rank skips (the ranks agree on it first, so none waits in a collective
// that a skipping peer never starts).

#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <thread>
#include <vector>

#include "kernels/cpu/cpu_kernels.hpp"
#include "src/cuda/cuda_resources.hpp"
#include "tests/gpu/gpu_test_util.hpp"
#include "tests/multirank/run_ranks.hpp"
#include "zeroshard/communicator.hpp"
#include "zeroshard/error.hpp"

namespace zeroshard {
namespace {

std::shared_ptr<Communicator> g_mpi;
std::string g_skip;  // non-empty: why every rank skips

using zs_gpu_test::DeviceBytes;

class StagedRanks : public ::testing::Test {
 protected:
  void SetUp() override {
    ZS_REQUIRE_GPU();
    if (!g_skip.empty()) GTEST_SKIP() << g_skip;
    ZS_CUDA_CHECK(cudaSetDevice(0));  // every rank on the same GPU
    comm_ = g_mpi;
    comm_->set_timeout(120);
    r_ = comm_->rank();
    p_ = comm_->size();
  }
  void TearDown() override {
    if (comm_) comm_->barrier("end of test");
  }
  std::shared_ptr<Communicator> comm_;
  int r_ = 0, p_ = 1;
};

// Σ over ranks q of (i % 13 + q), for global element i.
float rank_sum(int64_t i, int p) {
  return float(p * (i % 13) + p * (p - 1) / 2);
}

TEST_F(StagedRanks, ReduceScatterOfDeviceBuffers) {
  for (DType d : {DType::f32, DType::bf16}) {
    SCOPED_TRACE(dtype_name(d));
    const int64_t block = 1031;  // odd, not a multiple of any vector width
    const size_t es = dtype_size(d);
    std::vector<float> v(size_t(block * p_));
    for (size_t i = 0; i < v.size(); ++i) v[i] = float(int64_t(i) % 13 + r_);
    std::vector<unsigned char> bytes(v.size() * es);
    cpu::convert(cpu::Isa::scalar, v.data(), DType::f32, bytes.data(), d, int64_t(v.size()));
    DeviceBytes send(bytes);
    DeviceBytes recv(std::vector<unsigned char>(size_t(block) * es, 0xFF));  // NaN in both dtypes
    comm_->reduce_scatter(send.data(), recv.data(), block, d, "device grads")->wait();
    const auto got = recv.download<unsigned char>();
    std::vector<float> back(static_cast<size_t>(block));
    cpu::convert(cpu::Isa::scalar, got.data(), d, back.data(), DType::f32, block);
    for (int64_t i = 0; i < block; ++i)
      ASSERT_EQ(back[size_t(i)], rank_sum(r_ * block + i, p_)) << "element " << i;
    // The input is left as it was.
    EXPECT_EQ(send.download<unsigned char>(), bytes);
  }
}

TEST_F(StagedRanks, AllGatherOutOfPlaceAndInPlace) {
  const int64_t block = 777;
  std::vector<float> mine(static_cast<size_t>(block));
  for (int64_t i = 0; i < block; ++i) mine[size_t(i)] = float(r_ * 10000 + i);
  auto check = [&](const std::vector<float>& got) {
    for (int q = 0; q < p_; ++q)
      for (int64_t i = 0; i < block; ++i)
        ASSERT_EQ(got[size_t(q * block + i)], float(q * 10000 + i)) << "rank " << q << " " << i;
  };
  {
    SCOPED_TRACE("out of place");
    DeviceBytes send(mine);
    DeviceBytes recv(std::vector<float>(size_t(block * p_), -1.0f));
    comm_->all_gather(send.data(), recv.data(), block, DType::f32, "params")->wait();
    check(recv.download<float>());
  }
  {
    SCOPED_TRACE("in place");
    // Other ranks' blocks poisoned; this rank's block holds its data.
    std::vector<float> whole(size_t(block * p_), -1.0f);
    for (int64_t i = 0; i < block; ++i) whole[size_t(r_ * block + i)] = mine[size_t(i)];
    DeviceBytes buf(whole);
    auto work = comm_->all_gather(buf.as<float>() + r_ * block, buf.data(), block, DType::f32,
                                  "params in place");
    // Completion observed through done(): the copy back must be done before it says true.
    while (!work->done()) std::this_thread::yield();
    EXPECT_TRUE(work->wait_settled(10));
    EXPECT_GT(work->finished_at(), 0.0);
    EXPECT_LE(work->started_at(), work->finished_at());
    check(buf.download<float>());
    work->wait();  // no error, and no second copy over the result
    check(buf.download<float>());
  }
}

TEST_F(StagedRanks, BroadcastOfDeviceBytes) {
  const int root = p_ - 1;
  const std::string msg = "device bytes from the last rank";
  std::vector<char> data(msg.begin(), msg.end());
  if (r_ != root) data.assign(data.size(), 'x');
  DeviceBytes buf(data);
  comm_->broadcast(buf.data(), int64_t(data.size()), root, "message")->wait();
  const auto got = buf.download<char>();
  EXPECT_EQ(std::string(got.begin(), got.end()), msg);
}

TEST_F(StagedRanks, HostSendDeviceRecvAndHostControl) {
  // A host input with a device output: only the output is staged.
  const int64_t block = 300;
  std::vector<float> send(size_t(block * p_));
  for (size_t i = 0; i < send.size(); ++i) send[i] = float(int64_t(i) % 13 + r_);
  DeviceBytes recv(std::vector<float>(static_cast<size_t>(block), -1.0f));
  comm_->reduce_scatter(send.data(), recv.data(), block, DType::f32, "host to device")->wait();
  const auto got = recv.download<float>();
  for (int64_t i = 0; i < block; ++i)
    ASSERT_EQ(got[size_t(i)], rank_sum(r_ * block + i, p_)) << "element " << i;

  // And the reverse for the gather: a device input, a host output.
  DeviceBytes dsend(std::vector<float>(static_cast<size_t>(block), float(r_ + 1)));
  std::vector<float> hrecv(size_t(block * p_), -1.0f);
  comm_->all_gather(dsend.data(), hrecv.data(), block, DType::f32, "device to host")->wait();
  for (int q = 0; q < p_; ++q)
    for (int64_t i = 0; i < block; ++i) ASSERT_EQ(hrecv[size_t(q * block + i)], float(q + 1));

  // Host-only calls are untouched, all_reduce included.
  double v[2] = {double(r_), double(r_)};
  comm_->all_reduce(v, 1, ReduceOp::sum, "sum")->wait();
  comm_->all_reduce(v + 1, 1, ReduceOp::max, "max")->wait();
  EXPECT_EQ(v[0], double(p_ * (p_ - 1) / 2));
  EXPECT_EQ(v[1], double(p_ - 1));
}

TEST_F(StagedRanks, ManyCallsInFlight) {
  // Many calls in flight at once, each with its own staging, then waited in reverse order.
  const int64_t block = 4096;
  std::vector<DeviceBytes> sends, recvs;
  std::vector<std::shared_ptr<Work>> works;
  for (int k = 0; k < 8; ++k) {
    sends.emplace_back(std::vector<float>(size_t(block * p_), float(k + r_)));
    recvs.emplace_back(std::vector<float>(static_cast<size_t>(block), -1.0f));
  }
  for (int k = 0; k < 8; ++k)
    works.push_back(comm_->reduce_scatter(sends[size_t(k)].data(), recvs[size_t(k)].data(), block,
                                          DType::f32, "unit " + std::to_string(k)));
  for (int k = 7; k >= 0; --k) works[size_t(k)]->wait();
  for (int k = 0; k < 8; ++k) {
    const auto got = recvs[size_t(k)].download<float>();
    const float want = float(p_ * k + p_ * (p_ - 1) / 2);
    for (int64_t i = 0; i < block; ++i) ASSERT_EQ(got[size_t(i)], want) << "unit " << k;
  }
}

}  // namespace
}  // namespace zeroshard

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  using namespace zeroshard;
  g_mpi = make_mpi_communicator();
  // Every rank skips if any rank has no GPU (the ranks then never start a collective alone).
  std::string why;
  const int gpus = cuda::device_count(&why);
  double ok = gpus > 0 ? 1.0 : 0.0;
  g_mpi->all_reduce(&ok, 1, ReduceOp::min, "GPU check")->wait();
  if (gpus == 0) {
    g_skip = "no CUDA GPU on this machine: " + why;
  } else if (ok == 0.0) {
    g_skip = "another rank has no CUDA GPU";
  } else {
    g_mpi = stage_device_buffers(g_mpi);
  }
  const int rc = zs_test::run_on_all_ranks(*g_mpi);
  g_mpi.reset();
  return rc;
}
