#pragma once
// The speculative step's thread (Config::speculative_step, docs/tiers.md): a tier's work posted
// during backward, run in the order posted on one thread of its own, beside the trainer's.

#include <condition_variable>
#include <deque>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#include "base/layout.hpp"
#include "kernels/cpu/arena.hpp"
#include "kernels/cpu/cpu_kernels.hpp"
#include "src/tiers/tier.hpp"

namespace zeroshard {

/// Whether a speculation that read `spec_hyper` over `spec_runs` computed bitwise what an update
/// with `hyper` over `runs` computes (the same step is the caller's to check).
bool same_update(const std::vector<cpu::UpdateHyper>& spec_hyper,
                 const std::vector<GroupRun>& spec_runs, const std::vector<cpu::UpdateHyper>& hyper,
                 const std::vector<GroupRun>& runs);

/// A kept speculation's new low-precision values of unit u (`bytes` at `out`: the tier's `own`
/// buffer, or memory its caller brought) made sink.target(u)'s: nothing where they are there
/// already, a swap where the sink adopts `own` (`out` then points at own's new memory), else a
/// copy on `arena`.
void hand_to_sink(ParamSink& sink, int u, Buffer& own, void*& out, size_t bytes, cpu::Arena& arena);

class SpeculationThread {
 public:
  SpeculationThread() = default;
  SpeculationThread(const SpeculationThread&) = delete;
  SpeculationThread& operator=(const SpeculationThread&) = delete;
  /// Finishes the job running, drops the ones not started, and ends the thread.
  ~SpeculationThread();

  /// Runs `job` after the jobs posted before it; with `first`, before every job posted
  /// without it that has not started yet. The thread starts with the first job.
  void post(std::function<void()> job, bool first = false);
  /// Returns once every job posted has run: what they wrote may be read.
  void settle();
  /// Returns once every job posted with `first` has run.
  void settle_first();
  /// After settle(): the first exception a job threw since the last call, or null.
  std::exception_ptr take_failure();

 private:
  void run();

  std::mutex mu_;
  std::condition_variable wake_, idle_;
  std::deque<std::function<void()>> first_, jobs_;
  bool busy_ = false, busy_first_ = false, stop_ = false;
  std::exception_ptr failed_;
  std::thread thread_;
};

}  // namespace zeroshard
