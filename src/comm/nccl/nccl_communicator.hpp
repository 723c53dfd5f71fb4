#pragma once
// The NCCL communicator's internal face: what the GPU engine needs beyond the Communicator
// interface (stream ordering without host synchronisation) is the DeviceCommunicator interface
// of src/comm. The public contract is in include/zeroshard/communicator.hpp
// (make_nccl_communicator).

#include <cuda_runtime_api.h>

#include <memory>

#include "src/compute/device_communicator.hpp"

namespace zeroshard {

class NcclCommunicator final : public DeviceCommunicator {
 public:
  /// Collective over `bootstrap`'s ranks; see make_nccl_communicator().
  NcclCommunicator(int device, Communicator& bootstrap);
  ~NcclCommunicator() override;
  NcclCommunicator(const NcclCommunicator&) = delete;
  NcclCommunicator& operator=(const NcclCommunicator&) = delete;

  int rank() const override;
  int size() const override;
  std::shared_ptr<Work> reduce_scatter(const void* send, void* recv, int64_t recv_count,
                                       DType dtype, std::string what) override;
  std::shared_ptr<Work> all_gather(const void* send, void* recv, int64_t send_count, DType dtype,
                                   std::string what) override;
  std::shared_ptr<Work> all_reduce(double* inout, int64_t count, ReduceOp op,
                                   std::string what) override;
  std::shared_ptr<Work> all_reduce_sum(void* inout, int64_t count, DType dtype,
                                       std::string what) override;
  std::shared_ptr<Work> broadcast(void* data, int64_t bytes, int root, std::string what) override;
  std::shared_ptr<Work> all_to_all(const void* send, const Pieces& sends, void* recv,
                                   const Pieces& recvs, DType dtype, std::string what) override;
  void barrier(std::string what) override;
  std::shared_ptr<Communicator> split(const std::vector<int>& ranks, std::string what) override;
  void set_timeout(double seconds) override;

  int device() const override;
  void set_input_stream(void* stream) override;
  void order_before(void* stream) override;
  /// The stream collectives run on, in call order.
  cudaStream_t comm_stream() const;

 private:
  // split(): the streams and staging of `size` ranks on `device`; the caller sets the NCCL
  // communicator and starts the watcher.
  NcclCommunicator(int device, int rank, int size, double timeout_s);
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace zeroshard
