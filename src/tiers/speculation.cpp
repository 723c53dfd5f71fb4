// The speculative step's thread (see speculation.hpp).
#include "src/tiers/speculation.hpp"

#include <utility>

namespace zeroshard {

SpeculationThread::~SpeculationThread() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
    jobs_.clear();  // what they would compute is not wanted any more
  }
  wake_.notify_one();
  if (thread_.joinable()) thread_.join();
}

void SpeculationThread::post(std::function<void()> job) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    jobs_.push_back(std::move(job));
    if (!thread_.joinable()) thread_ = std::thread([this] { run(); });
  }
  wake_.notify_one();
}

void SpeculationThread::settle() {
  std::unique_lock<std::mutex> lock(mu_);
  idle_.wait(lock, [this] { return jobs_.empty() && !busy_; });
}

std::exception_ptr SpeculationThread::take_failure() {
  std::lock_guard<std::mutex> lock(mu_);
  return std::exchange(failed_, nullptr);
}

void SpeculationThread::run() {
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    wake_.wait(lock, [this] { return stop_ || !jobs_.empty(); });
    if (jobs_.empty()) return;  // stopped, and nothing left to run
    std::function<void()> job = std::move(jobs_.front());
    jobs_.pop_front();
    busy_ = true;
    lock.unlock();
    std::exception_ptr failed;
    try {
      job();
    } catch (...) {
      failed = std::current_exception();
    }
    lock.lock();
    if (failed && !failed_) failed_ = failed;
    busy_ = false;
    if (jobs_.empty()) idle_.notify_all();
  }
}

}  // namespace zeroshard
