// PeerProbe: pings on a duplicate communicator, answered by every rank's communication thread.

#include "src/comm/mpi/peer_probe.hpp"

#include <unistd.h>

#include <cstring>

#include "base/check.hpp"
#include "base/mpi_check.hpp"

namespace zeroshard {
namespace {
// The answer's payload; sends read it until they complete, so it lives for the process.
const int kAnswer = 1;
}  // namespace

PeerProbe::PeerProbe(MPI_Comm comm) {
  ZS_MPI_CHECK(MPI_Comm_dup(comm, &comm_));
  ZS_MPI_CHECK(MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN));
  ZS_MPI_CHECK(MPI_Comm_rank(comm_, &rank_));
  ZS_MPI_CHECK(MPI_Comm_size(comm_, &size_));
  char mine[kHostBytes] = {};
  if (gethostname(mine, sizeof mine - 1) != 0) std::strcpy(mine, "?");
  std::vector<char> all(size_t(size_) * kHostBytes);
  ZS_MPI_CHECK(MPI_Allgather(mine, kHostBytes, MPI_CHAR, all.data(), kHostBytes, MPI_CHAR, comm_));
  for (int r = 0; r < size_; ++r)
    hosts_.emplace_back(all.data() + size_t(r) * kHostBytes,
                        strnlen(all.data() + size_t(r) * kHostBytes, kHostBytes));
  pong_in_.assign(size_t(size_), 0);
  pong_req_.assign(size_t(size_), MPI_REQUEST_NULL);
  answered_.assign(size_t(size_), 1);
  ZS_MPI_CHECK(MPI_Irecv(&ping_in_, 1, MPI_INT, MPI_ANY_SOURCE, kPing, comm_, &ping_req_));
}

void PeerProbe::close(bool leak) {
  if (closed_) return;
  closed_ = true;
  if (leak) return;
  // Pending receives are cancelled (a ping or answer that never comes), then the duplicate goes.
  auto cancel = [](MPI_Request& r) {
    if (r == MPI_REQUEST_NULL) return;
    MPI_Cancel(&r);
    MPI_Wait(&r, MPI_STATUS_IGNORE);
  };
  cancel(ping_req_);
  for (MPI_Request& r : pong_req_) cancel(r);
  MPI_Comm_free(&comm_);
}

void PeerProbe::serve() noexcept {
  for (;;) {
    int flag = 0;
    MPI_Status st;
    if (ping_req_ == MPI_REQUEST_NULL || MPI_Test(&ping_req_, &flag, &st) != MPI_SUCCESS || !flag)
      return;
    MPI_Request send = MPI_REQUEST_NULL;
    if (MPI_Isend(&kAnswer, 1, MPI_INT, st.MPI_SOURCE, kPong, comm_, &send) == MPI_SUCCESS)
      MPI_Request_free(&send);
    if (MPI_Irecv(&ping_in_, 1, MPI_INT, MPI_ANY_SOURCE, kPing, comm_, &ping_req_) != MPI_SUCCESS)
      ping_req_ = MPI_REQUEST_NULL;
  }
}

void PeerProbe::start(std::chrono::steady_clock::time_point since) noexcept {
  if (probing_ && started_ >= since) return;
  probing_ = true;
  started_ = std::chrono::steady_clock::now();
  for (int q = 0; q < size_; ++q) {
    if (q == rank_) continue;
    answered_[size_t(q)] = 0;
    // One answer is awaited per peer. One that came before this ping answered an earlier probe
    // and is dropped; one still awaited counts for this probe when it comes, since it comes
    // later. (Tested before the ping goes, so that the ping's own answer is never dropped.)
    MPI_Request& pong = pong_req_[size_t(q)];
    int came = 0;
    if (pong != MPI_REQUEST_NULL) MPI_Test(&pong, &came, MPI_STATUS_IGNORE);
    if (pong == MPI_REQUEST_NULL)
      MPI_Irecv(&pong_in_[size_t(q)], 1, MPI_INT, q, kPong, comm_, &pong);
    MPI_Request send = MPI_REQUEST_NULL;
    if (MPI_Isend(&kAnswer, 1, MPI_INT, q, kPing, comm_, &send) == MPI_SUCCESS)
      MPI_Request_free(&send);
  }
}

std::string PeerProbe::silent() noexcept {
  serve();
  std::string list;
  for (int q = 0; q < size_; ++q) {
    if (answered_[size_t(q)]) continue;
    int flag = 0;
    if (pong_req_[size_t(q)] != MPI_REQUEST_NULL &&
        MPI_Test(&pong_req_[size_t(q)], &flag, MPI_STATUS_IGNORE) == MPI_SUCCESS && flag) {
      answered_[size_t(q)] = 1;
      continue;
    }
    list += (list.empty() ? "" : ", ") + std::string("rank ") + std::to_string(q) + " (host " +
            hosts_[size_t(q)] + ")";
  }
  if (list.empty()) probing_ = false;
  return list;
}

}  // namespace zeroshard
