// Built when ZEROSHARD_WITH_MPI is OFF: asking for MPI is an error that says how to get it.
#include "base/check.hpp"
#include "zeroshard/communicator.hpp"

namespace zeroshard {
std::shared_ptr<Communicator> make_mpi_communicator() {
  ZS_THROW(comm_failure,
           "make_mpi_communicator: zeroshard was built with ZEROSHARD_WITH_MPI=OFF; "
           "rebuild with it ON or use make_self_communicator()");
}
void abort_mpi_job(int) {}
void finalize_mpi() {}
}  // namespace zeroshard
