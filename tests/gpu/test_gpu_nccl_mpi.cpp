// The NCCL communicator across ranks, under mpirun with one GPU per rank (NCCL allows no two
// ranks on one GPU). Every rank agrees to skip when the machine has fewer GPUs than local ranks.
// Results are compared exactly: the inputs are small integers, exact in every dtype and sum.
// Timeout: rank 0 alone starts a collective, which fails with ErrorCode::timeout naming it.

#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <numeric>
#include <string>
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
int g_device = 0;

using zs_gpu_test::DeviceBytes;

int env_int(const char* name, int fallback) {
  const char* s = std::getenv(name);
  return s ? std::atoi(s) : fallback;
}

class NcclRanks : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!g_skip.empty()) GTEST_SKIP() << g_skip;
    comm_ = make_nccl_communicator(g_device, g_mpi);
    comm_->set_timeout(120);
  }
  std::shared_ptr<Communicator> comm_;
};

TEST_F(NcclRanks, ReduceScatterSumsAcrossRanks) {
  const int r = comm_->rank(), p = comm_->size();
  EXPECT_EQ(r, g_mpi->rank());
  for (DType d : {DType::f32, DType::bf16, DType::f16}) {
    SCOPED_TRACE(dtype_name(d));
    const int64_t block = 257;
    std::vector<float> v(size_t(block * p));
    for (size_t i = 0; i < v.size(); ++i) v[i] = float((i % 13) + r);  // Σ over ranks stays small
    std::vector<unsigned char> bytes(v.size() * dtype_size(d));
    cpu::convert(cpu::Isa::scalar, v.data(), DType::f32, bytes.data(), d, int64_t(v.size()));
    DeviceBytes send(bytes), recv(size_t(block) * dtype_size(d));
    comm_->reduce_scatter(send.data(), recv.data(), block, d, "unit 'u'")->wait();
    const auto got = recv.download<unsigned char>();
    std::vector<float> back(static_cast<size_t>(block));
    cpu::convert(cpu::Isa::scalar, got.data(), d, back.data(), DType::f32, block);
    for (int64_t i = 0; i < block; ++i) {
      const int64_t g = r * block + i;
      const float want = float(p * (g % 13) + p * (p - 1) / 2);
      ASSERT_EQ(back[size_t(i)], want) << "element " << i;
    }
  }
}

TEST_F(NcclRanks, AllGatherInPlaceAndHostAllReduce) {
  const int r = comm_->rank(), p = comm_->size();
  const int64_t block = 1000;
  std::vector<float> whole(size_t(block * p), -1.0f);
  for (int64_t i = 0; i < block; ++i) whole[size_t(r * block + i)] = float(r * 10000 + i);
  DeviceBytes buf(whole);
  comm_->all_gather(buf.as<float>() + r * block, buf.data(), block, DType::f32, "params")->wait();
  const auto got = buf.download<float>();
  for (int q = 0; q < p; ++q)
    for (int64_t i = 0; i < block; ++i) ASSERT_EQ(got[size_t(q * block + i)], float(q * 10000 + i));
  double v[3] = {double(r), double(r), double(r)};
  comm_->all_reduce(v, 1, ReduceOp::sum, "sum")->wait();
  comm_->all_reduce(v + 1, 1, ReduceOp::max, "max")->wait();
  comm_->all_reduce(v + 2, 1, ReduceOp::min, "min")->wait();
  EXPECT_EQ(v[0], double(p * (p - 1) / 2));
  EXPECT_EQ(v[1], double(p - 1));
  EXPECT_EQ(v[2], 0.0);
  std::string msg = r == p - 1 ? "from the last rank" : "xxxxxxxxxxxxxxxxxx";
  comm_->broadcast(msg.data(), int64_t(msg.size()), p - 1, "message")->wait();
  EXPECT_EQ(msg, "from the last rank");
  comm_->barrier("end");
}

TEST_F(NcclRanks, TimeoutNamesTheCollective) {
  comm_->set_timeout(2.0);
  if (comm_->rank() == 0) {
    double x = 1;
    try {
      comm_->all_reduce(&x, 1, ReduceOp::sum, "only rank 0 calls this")->wait();
      FAIL() << "a collective joined by one rank completed";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::timeout) << e.what();
      EXPECT_NE(std::string(e.what()).find("rank 0: all_reduce of only rank 0 calls this"),
                std::string::npos)
          << e.what();
    }
  }
  // Every rank drops this communicator; the MPI world keeps them in step for the next test.
  comm_.reset();
  g_mpi->barrier("after the timeout test");
}

}  // namespace
}  // namespace zeroshard

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  using namespace zeroshard;
  g_mpi = make_mpi_communicator();
  // One GPU per local rank, or every rank skips (they must agree, or NCCL set-up would hang).
  std::string why;
  const int gpus = cuda::device_count(&why);
  const int local_rank = env_int("OMPI_COMM_WORLD_LOCAL_RANK", g_mpi->rank());
  const int local_size = env_int("OMPI_COMM_WORLD_LOCAL_SIZE", g_mpi->size());
  double ok = gpus >= local_size ? 1.0 : 0.0;
  g_mpi->all_reduce(&ok, 1, ReduceOp::min, "GPU check")->wait();
  if (gpus == 0) {
    g_skip = "no CUDA GPU on this machine: " + why;
  } else if (ok == 0.0) {
    g_skip = "need one CUDA GPU per rank: this machine has " + std::to_string(gpus) + " for " +
             std::to_string(local_size) + " local ranks (or another machine has too few)";
  }
  g_device = gpus > 0 ? local_rank % gpus : 0;
  const int rc = zs_test::run_on_all_ranks(*g_mpi);
  g_mpi.reset();
  return rc;
}
