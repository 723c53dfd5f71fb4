#pragma once
// A communicator that moves device memory on the device itself, ordered by streams instead of
// host synchronisation (the NCCL communicator). The stream-ordered backends (stream_compute.cpp)
// ask a communicator for this face instead of naming a backend: src/comm/nccl builds on
// src/compute and src/cuda, never the reverse, so the include graph between rooms stays a DAG.
// Streams are opaque (a cudaStream_t passed as void*), so this header stays free of CUDA headers.

#include "zeroshard/communicator.hpp"

namespace zeroshard {

class DeviceCommunicator : public Communicator {
 public:
  /// The CUDA device every buffer must live on (−1: the asynchronous CPU device, which plays
  /// NCCL's ordering on the CPU; src/compute/async_device_communicator.hpp).
  virtual int device() const = 0;
  /// Collectives called from now on first wait (on the device) for the work queued on `stream`
  /// (the device's stream: a cudaStream_t, or a stream of the asynchronous CPU device) at their
  /// call, instead of the legacy default stream's; nullptr restores that default. The engine sets
  /// its compute stream here so gradients are reduced once backward wrote them.
  virtual void set_input_stream(void* stream) = 0;
  /// Makes `stream` (as above) wait, on the device, for every collective called so far,
  /// so kernels that consume gathered parameters can be queued without waiting on the host.
  virtual void order_before(void* stream) = 0;
};

/// `comm` as a DeviceCommunicator, or null when it moves host memory (MPI, one rank, staged).
inline DeviceCommunicator* as_device_communicator(Communicator* comm) {
  return dynamic_cast<DeviceCommunicator*>(comm);
}

}  // namespace zeroshard
