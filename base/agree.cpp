#include "base/agree.hpp"

namespace zeroshard {

// The lowest failing rank's error is broadcast, so every rank's message names the path, unit
// and operation that failed.
std::optional<Error> agree(Communicator& comm, const std::optional<Error>& mine,
                           const std::string& what) {
  const int rank = comm.rank(), world = comm.size();
  if (world == 1) return mine;
  double first = mine ? double(rank) : double(world);
  comm.all_reduce(&first, 1, ReduceOp::min, what + " (failure check)")->wait();
  if (first >= world) return std::nullopt;
  const int src = int(first);
  std::string msg = rank == src ? std::string(mine->what()) : std::string();
  double meta[2] = {rank == src ? double(int(mine->code())) : 0.0, double(msg.size())};
  comm.broadcast(meta, int64_t(sizeof meta), src, what + " (failure code)")->wait();
  msg.resize(size_t(meta[1]));
  if (!msg.empty())
    comm.broadcast(msg.data(), int64_t(msg.size()), src, what + " (failure message)")->wait();
  const ErrorCode code = ErrorCode(int(meta[0]));
  if (rank == src) return Error(code, msg);
  return Error(code, "rank " + std::to_string(rank) + ": " + what + " failed on rank " +
                         std::to_string(src) + ": " + msg);
}

std::string not_applied(int64_t step) {
  return "; step " + std::to_string(step) +
         " was not applied on any rank: parameters and optimizer state are those of " +
         (step > 1 ? "step " + std::to_string(step - 1) : std::string("finalize()")) +
         " (save a checkpoint and stop, or retry the step)";
}

}  // namespace zeroshard
