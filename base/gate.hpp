#pragma once
// A one-shot gate: closed until one thread opens it, and every wait() returns once it is open.
// A save's copy into its snapshot (Engine::Impl::before_state_change() waits for it), an event
// recorded on a stream of the asynchronous CPU device (async_device_communicator.cpp).

#include <condition_variable>
#include <mutex>

namespace zeroshard {

class Gate {
 public:
  void open() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      open_ = true;
    }
    cv_.notify_all();
  }
  void wait() {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return open_; });
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool open_ = false;
};

}  // namespace zeroshard
