#include <chrono>
#include <thread>

#include "src/comm/work_state.hpp"

namespace zeroshard {

static double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

void WorkState::mark_started() {
  std::lock_guard<std::mutex> lock(mu_);
  started_ = now_s();
}

double WorkState::started_at() {
  std::lock_guard<std::mutex> lock(mu_);
  return started_;
}

double WorkState::finished_at() {
  std::lock_guard<std::mutex> lock(mu_);
  return finished_;
}

void WorkState::wait() {
  // Small collectives finish within microseconds of being started: a short spin saves the
  // futex sleep and wake-up, which would otherwise cost more than the collective itself.
  const auto spin_until = std::chrono::steady_clock::now() + std::chrono::microseconds(50);
  while (!done() && std::chrono::steady_clock::now() < spin_until) std::this_thread::yield();
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [&] { return state_ != State::pending; });
  if (state_ == State::failed) throw Error(code_, message_);
}

bool WorkState::done() {
  std::lock_guard<std::mutex> lock(mu_);
  return state_ != State::pending;
}

bool WorkState::failed() {
  std::lock_guard<std::mutex> lock(mu_);
  return state_ == State::failed;
}

void WorkState::complete() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    settled_ = true;
    finished_ = now_s();
    if (started_ == 0) started_ = finished_;
    if (state_ == State::pending) state_ = State::ok;
  }
  cv_.notify_all();
}

void WorkState::settle() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    settled_ = true;
  }
  cv_.notify_all();
}

bool WorkState::wait_settled(double max_seconds) {
  std::unique_lock<std::mutex> lock(mu_);
  return cv_.wait_for(lock, std::chrono::duration<double>(max_seconds), [&] { return settled_; });
}

void WorkState::fail(ErrorCode code, std::string message) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (state_ != State::pending) return;
    state_ = State::failed;
    code_ = code;
    message_ = std::move(message);
  }
  cv_.notify_all();
}

}  // namespace zeroshard
