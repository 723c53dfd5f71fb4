#pragma once
// The Work handle shared by the communicators: a one-shot completion with an optional error.

#include <condition_variable>
#include <memory>
#include <mutex>
#include <string>

#include "zeroshard/communicator.hpp"
#include "zeroshard/error.hpp"

namespace zeroshard {

class WorkState final : public Work {
 public:
  explicit WorkState(std::string what) : what_(std::move(what)) {}
  void wait() override;
  bool done() override;
  bool wait_settled(double max_seconds) override;
  double started_at() override;
  double finished_at() override;
  /// The backend has started the collective (for timing).
  void mark_started();
  /// The backend is done with the buffers (after complete(), or late after a timeout).
  void settle();
  /// True once completed with an error.
  bool failed();
  void complete();
  void fail(ErrorCode code, std::string message);
  const std::string& what() const { return what_; }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  enum class State { pending, ok, failed } state_ = State::pending;
  bool settled_ = false;
  double started_ = 0, finished_ = 0;
  ErrorCode code_ = ErrorCode::internal;
  std::string message_;
  std::string what_;
};

/// A Work already complete: what a collective that ran synchronously returns.
inline std::shared_ptr<Work> done_work(std::string what) {
  auto w = std::make_shared<WorkState>(std::move(what));
  w->complete();
  return w;
}

}  // namespace zeroshard
