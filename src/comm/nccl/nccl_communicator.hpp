#pragma once
// The NCCL communicator's internal face: what the GPU engine needs beyond the Communicator
// interface (stream ordering without host synchronisation). The public contract is in
// include/zeroshard/communicator.hpp (make_nccl_communicator).

#include <cuda_runtime_api.h>

#include <memory>

#include "zeroshard/communicator.hpp"

namespace zeroshard {

class NcclCommunicator final : public Communicator {
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
  std::shared_ptr<Work> broadcast(void* data, int64_t bytes, int root, std::string what) override;
  void barrier(std::string what) override;
  void set_timeout(double seconds) override;

  /// The CUDA device every buffer must live on.
  int device() const;
  /// The stream collectives run on, in call order.
  cudaStream_t comm_stream() const;
  /// Collectives called from now on first wait (on the device) for the work queued on `stream`
  /// at their call, instead of the legacy default stream's; nullptr restores that default.
  /// The engine sets its compute stream here so gradients are reduced once backward wrote them.
  void set_input_stream(cudaStream_t stream);
  /// Makes `stream` wait, on the device, for every collective called so far, so kernels that
  /// consume gathered parameters can be queued without waiting on the host.
  void order_before(cudaStream_t stream);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace zeroshard
