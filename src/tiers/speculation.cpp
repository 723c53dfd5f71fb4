// The speculative step's thread (see speculation.hpp).
#include "src/tiers/speculation.hpp"

#include <algorithm>
#include <bit>
#include <cstdint>
#include <cstring>
#include <utility>

#include "base/ledger.hpp"

namespace zeroshard {

bool same_update(const std::vector<cpu::UpdateHyper>& spec_hyper,
                 const std::vector<GroupRun>& spec_runs, const std::vector<cpu::UpdateHyper>& hyper,
                 const std::vector<GroupRun>& runs) {
  auto bits = [](float x) { return std::bit_cast<uint32_t>(x); };
  auto same_hyper = [&](const cpu::UpdateHyper& a, const cpu::UpdateHyper& b) {
    return a.kind == b.kind && bits(a.lr) == bits(b.lr) && bits(a.beta1) == bits(b.beta1) &&
           bits(a.beta2) == bits(b.beta2) && bits(a.eps) == bits(b.eps) &&
           bits(a.weight_decay) == bits(b.weight_decay) && bits(a.momentum) == bits(b.momentum) &&
           a.nesterov == b.nesterov && bits(a.bias_correction1) == bits(b.bias_correction1) &&
           bits(a.bias_correction2) == bits(b.bias_correction2) &&
           bits(a.grad_scale) == bits(b.grad_scale) && a.hold == b.hold;
  };
  auto same_run = [](const GroupRun& x, const GroupRun& y) {
    return x.begin == y.begin && x.end == y.end && x.group == y.group;
  };
  return std::equal(spec_hyper.begin(), spec_hyper.end(), hyper.begin(), hyper.end(), same_hyper) &&
         std::equal(spec_runs.begin(), spec_runs.end(), runs.begin(), runs.end(), same_run);
}

void hand_to_sink(ParamSink& sink, int u, Buffer& own, void*& out, size_t bytes,
                  cpu::Arena& arena) {
  char* target = static_cast<char*>(sink.target(u));
  if (!target || target == out) return;
  if (out == own.data() && sink.adopt(u, own)) {  // a swap instead of a copy
    out = own.data();
    return;
  }
  const char* from = static_cast<const char*>(out);
  arena.parallel_chunks(int64_t(bytes), [&](int64_t b, int64_t e) {
    std::memcpy(target + b, from + b, size_t(e - b));
  });
}

SpeculationThread::~SpeculationThread() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
    first_.clear();  // what they would compute is not wanted any more
    jobs_.clear();
  }
  wake_.notify_one();
  if (thread_.joinable()) thread_.join();
}

void SpeculationThread::post(std::function<void()> job, bool first) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    (first ? first_ : jobs_).push_back(std::move(job));
    if (!thread_.joinable()) thread_ = std::thread([this] { run(); });
  }
  wake_.notify_one();
}

void SpeculationThread::settle() {
  std::unique_lock<std::mutex> lock(mu_);
  idle_.wait(lock, [this] { return first_.empty() && jobs_.empty() && !busy_; });
}

void SpeculationThread::settle_first() {
  std::unique_lock<std::mutex> lock(mu_);
  idle_.wait(lock, [this] { return first_.empty() && !busy_first_; });
}

std::exception_ptr SpeculationThread::take_failure() {
  std::lock_guard<std::mutex> lock(mu_);
  return std::exchange(failed_, nullptr);
}

void SpeculationThread::run() {
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    wake_.wait(lock, [this] { return stop_ || !first_.empty() || !jobs_.empty(); });
    if (first_.empty() && jobs_.empty()) return;  // stopped, and nothing left to run
    busy_first_ = !first_.empty();
    std::deque<std::function<void()>>& from = busy_first_ ? first_ : jobs_;
    std::function<void()> job = std::move(from.front());
    from.pop_front();
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
    const bool was_first = busy_first_;
    busy_ = busy_first_ = false;
    if (first_.empty() && (was_first || jobs_.empty())) idle_.notify_all();
  }
}

}  // namespace zeroshard
