#pragma once
// A stream of the asynchronous CPU device (async_cpu_device.cpp): a thread that runs the work
// issued to it in issue order, each piece after a seeded random delay, and keeps the first
// failure for the next synchronize(), as a CUDA stream reports an asynchronous error. Also the
// stream the device's NCCL-ordered communicator runs collectives on
// (async_device_communicator.cpp).

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <utility>

#include "zeroshard/error.hpp"

namespace zeroshard {

// One stream: a thread that runs its queue in order, counting the work issued and done.
class CpuStream {
 public:
  CpuStream(uint64_t seed, int jitter_us) : rng_(seed), jitter_us_(jitter_us) {
    thread_ = std::thread([this] { run(); });
  }
  // Finishes what was issued, then stops.
  ~CpuStream() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    work_cv_.notify_one();
    thread_.join();
  }
  CpuStream(const CpuStream&) = delete;
  CpuStream& operator=(const CpuStream&) = delete;

  void issue(std::function<void()> fn) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      queue_.push_back(std::move(fn));
      ++issued_;
    }
    work_cv_.notify_one();
  }
  // Work issued and not yet done.
  uint64_t pending() {
    std::lock_guard<std::mutex> lock(mu_);
    return issued_ - done_;
  }
  // Blocks until everything issued so far is done, keeping any failure for synchronize().
  void drain() {
    std::unique_lock<std::mutex> lock(mu_);
    const uint64_t target = issued_;
    done_cv_.wait(lock, [&] { return done_ >= target; });
  }
  // Blocks until everything issued so far is done; throws the first failure of this stream's
  // work (as a CUDA stream reports an asynchronous error at its synchronisation), once.
  void synchronize() {
    std::unique_lock<std::mutex> lock(mu_);
    const uint64_t target = issued_;
    done_cv_.wait(lock, [&] { return done_ >= target; });
    if (error_) std::rethrow_exception(std::exchange(error_, nullptr));
  }

 private:
  void run() {
    std::uniform_int_distribution<int> delay(0, jitter_us_);
    for (;;) {
      std::function<void()> fn;
      {
        std::unique_lock<std::mutex> lock(mu_);
        work_cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
        if (queue_.empty()) return;  // stopped, and nothing left
        fn = std::move(queue_.front());
        queue_.pop_front();
      }
      if (jitter_us_ > 0) std::this_thread::sleep_for(std::chrono::microseconds(delay(rng_)));
      // A failure is an Error, as CUDA's are, so that those who catch Error (a destructor's
      // last wait) catch it.
      std::exception_ptr failed;
      try {
        fn();
      } catch (const Error&) {
        failed = std::current_exception();
      } catch (const std::exception& e) {
        failed = std::make_exception_ptr(
            Error(ErrorCode::internal, std::string("asynchronous CPU device: ") + e.what()));
      } catch (...) {
        failed = std::make_exception_ptr(
            Error(ErrorCode::internal, "asynchronous CPU device: an unknown exception"));
      }
      {
        std::lock_guard<std::mutex> lock(mu_);
        if (failed && !error_) error_ = failed;
        ++done_;
      }
      done_cv_.notify_all();
    }
  }

  std::mutex mu_;
  std::condition_variable work_cv_, done_cv_;
  std::deque<std::function<void()>> queue_;  // guarded by mu_, as are the four below
  uint64_t issued_ = 0, done_ = 0;
  std::exception_ptr error_;
  bool stop_ = false;
  std::mt19937_64 rng_;  // the stream thread's own
  const int jitter_us_;
  std::thread thread_;
};

}  // namespace zeroshard
