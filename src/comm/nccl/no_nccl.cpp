// Built when ZEROSHARD_WITH_CUDA is OFF: asking for NCCL is an error that says how to get it.
#include "check.hpp"
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

}  // namespace zeroshard
