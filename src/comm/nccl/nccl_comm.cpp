#include "src/comm/nccl/nccl_comm.hpp"

#include <chrono>
#include <thread>
#include <utility>

#include "base/nccl_check.hpp"
#include "src/comm/timeout.hpp"

namespace zeroshard {
namespace {

using Clock = std::chrono::steady_clock;

Clock::time_point after(double seconds) {
  return Clock::now() + timeout_duration<Clock>(seconds);
}

}  // namespace

NcclComm::NcclComm(NcclComm&& o) noexcept : comm_(std::exchange(o.comm_, nullptr)) {}

NcclComm& NcclComm::operator=(NcclComm&& o) noexcept {
  if (this != &o) {
    abort();
    comm_ = std::exchange(o.comm_, nullptr);
  }
  return *this;
}

NcclComm NcclComm::init(int size, const ncclUniqueId& id, int rank, double timeout_s,
                        const std::string& who) {
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;  // no NCCL call may wait forever: set-up is polled with a deadline
  ncclComm_t raw = nullptr;
  const ncclResult_t rc = ncclCommInitRankConfig(&raw, size, id, rank, &config);
  return ready(raw, rc, timeout_s, who, "ncclCommInitRankConfig");
}

NcclComm NcclComm::split(ncclComm_t parent, int color, int key, double timeout_s,
                         const std::string& who) {
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  ncclComm_t raw = nullptr;
  const ncclResult_t rc = ncclCommSplit(parent, color, key, &raw, &config);
  return ready(raw, rc, timeout_s, who, "ncclCommSplit");
}

NcclComm NcclComm::ready(ncclComm_t raw, ncclResult_t rc, double timeout_s, const std::string& who,
                         const char* call) {
  // Owned from here on, before the result is checked: a throw aborts a half-made communicator.
  NcclComm comm(raw);
  ZS_NCCL_CHECK_ASYNC(rc, cuda_error, nullptr, rc, who << " (" << call << ")");
  const auto deadline = after(timeout_s);
  int polls = 0;
  while (rc == ncclInProgress && comm) {
    if (Clock::now() > deadline)
      ZS_THROW(timeout, who << ": " << call << " did not complete within " << timeout_s
                            << " s (a peer rank is late or dead)");
    if (++polls > 64) std::this_thread::sleep_for(std::chrono::microseconds(200));
    rc = comm.async_state();
  }
  if (rc != ncclSuccess)
    ZS_THROW(cuda_error, who << ": " << call << " failed: " << nccl::error_string(rc, comm.get()));
  return comm;
}

ncclResult_t NcclComm::async_state() const noexcept {
  ncclResult_t state = ncclSuccess;
  const ncclResult_t q = ncclCommGetAsyncError(comm_, &state);
  return q != ncclSuccess ? q : state;
}

void NcclComm::abort() noexcept {
  if (comm_ != nullptr) (void)ncclCommAbort(std::exchange(comm_, nullptr));
}

bool NcclComm::finalize(double timeout_s) noexcept {
  if (comm_ == nullptr) return false;
  ncclResult_t rc = ncclCommFinalize(comm_);
  const auto deadline = after(timeout_s);
  while (rc == ncclInProgress && Clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::microseconds(200));
    rc = async_state();
  }
  if (rc == ncclSuccess && ncclCommDestroy(comm_) == ncclSuccess) {
    comm_ = nullptr;
    return true;
  }
  abort();
  return false;
}

}  // namespace zeroshard
