// Built when ZEROSHARD_WITH_CUDA is OFF: asking for NCCL, or for device buffers, is an error
// that says how to get it.
#include "base/check.hpp"
#include "zeroshard/communicator.hpp"

namespace zeroshard {

std::shared_ptr<Communicator> make_nccl_communicator(int device) {
  ZS_THROW(comm_failure,
           "make_nccl_communicator("
               << device
               << "): zeroshard was built without CUDA (ZEROSHARD_WITH_CUDA=OFF), so "
                  "it has no NCCL communicator; rebuild with -DZEROSHARD_WITH_CUDA=ON "
                  "(needs the CUDA toolkit and NCCL) or use make_mpi_communicator()");
}

std::shared_ptr<Communicator> make_nccl_communicator(int device, std::shared_ptr<Communicator>) {
  return make_nccl_communicator(device);
}

std::shared_ptr<Communicator> stage_device_buffers(std::shared_ptr<Communicator>) {
  ZS_THROW(comm_failure,
           "stage_device_buffers(): zeroshard was built without CUDA (ZEROSHARD_WITH_CUDA=OFF), "
           "so no buffer can be GPU memory; pass the communicator itself");
}

}  // namespace zeroshard
