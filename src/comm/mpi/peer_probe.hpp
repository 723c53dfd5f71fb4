#pragma once
// PeerProbe: which peers of an MPI communicator still answer. When a collective is about to time
// out, the communication thread pings every peer on a communicator of its own; every peer's
// communication thread answers pings whenever it runs (between collectives too), so a peer that
// does not answer before the deadline is dead, stopped, or cut off from this host, and the
// timeout's error can name it and its host, instead of "a peer rank is late".
//
// Communication thread only, except the constructor and the destructor.

#include <mpi.h>

#include <chrono>
#include <string>
#include <vector>

namespace zeroshard {

class PeerProbe {
 public:
  /// Collective over `comm`: duplicates it and learns every rank's host name.
  explicit PeerProbe(MPI_Comm comm);
  /// `leak`: a collective of the communicator was abandoned, so MPI may still touch it: the
  /// duplicate is left to the process's end as the communicator itself is.
  void close(bool leak);
  ~PeerProbe() { close(true); }
  PeerProbe(const PeerProbe&) = delete;
  PeerProbe& operator=(const PeerProbe&) = delete;

  /// Answers the pings that arrived. Never throws.
  void serve() noexcept;
  /// Pings every peer, unless a probe begun at or after `since` is running: a probe answers
  /// for the collectives whose last quarter it began in, not for later ones.
  void start(std::chrono::steady_clock::time_point since) noexcept;
  /// "rank 2 (host a), rank 3 (host a)": the peers that have not answered the running probe;
  /// empty once all did (then the probe ends, and start() may begin another).
  std::string silent() noexcept;

 private:
  static constexpr int kPing = 1, kPong = 2, kHostBytes = 64;
  MPI_Comm comm_ = MPI_COMM_NULL;
  int rank_ = 0, size_ = 1;
  std::vector<std::string> hosts_;
  int ping_in_ = 0;
  MPI_Request ping_req_ = MPI_REQUEST_NULL;
  std::vector<int> pong_in_;
  std::vector<MPI_Request> pong_req_;  // per peer: the pending receive of its answer
  std::vector<char> answered_;
  bool probing_ = false;
  std::chrono::steady_clock::time_point started_{};
  bool closed_ = false;
};

}  // namespace zeroshard
