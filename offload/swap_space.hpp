#pragma once
// The nvme tier's shared ground: the run directories (one per distinct path, shared by the
// state's and the parameters' files) and the one io_uring ring through which both tiers' files
// and staging slots are registered. Owned by the engine's Resources.
//
// Lifetime: tiers register their stores and pools, then start() opens the ring. stop() drains
// and closes it; the owner calls it before the tiers' memory goes. The directories (and the
// files in them) are removed when the SwapSpace dies, after the tiers closed their files.

#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "offload/io_queue.hpp"
#include "offload/pinned_pool.hpp"
#include "offload/run_dir.hpp"
#include "offload/swap_store.hpp"
#include "zeroshard/config.hpp"

namespace zeroshard::offload {

class SwapSpace {
 public:
  explicit SwapSpace(int rank) : rank_(rank) {}
  ~SwapSpace() { stop(); }
  SwapSpace(const SwapSpace&) = delete;
  SwapSpace& operator=(const SwapSpace&) = delete;

  /// The run directory of each path (created on first use), for a SwapStore.
  std::vector<const RunDir*> dirs(const std::vector<std::string>& paths);
  /// Files and staging memory the ring registers (before start()).
  void add(SwapStore* store) { stores_.push_back(store); }
  void add(PinnedPool* pool) { pools_.push_back(pool); }
  /// Opens the ring with every added file and slot registered once.
  void start(const AioOptions& aio);
  /// What a tier whose own thread submits I/O (the speculative step's) runs before the ring
  /// closes: it stops that thread's work and waits for its I/O. Run once; must not throw.
  /// Returns a key for forget_before_stop(), which the tier calls when it goes first.
  size_t before_stop(std::function<void()> quiesce) {
    quiesce_.push_back(std::move(quiesce));
    return quiesce_.size() - 1;
  }
  void forget_before_stop(size_t key) {
    if (key < quiesce_.size()) quiesce_[key] = nullptr;
  }
  /// Waits for the I/O in flight and closes the ring. Idempotent.
  void stop() noexcept {
    for (auto& q : std::exchange(quiesce_, {}))
      if (q) q();
    io_.reset();
  }

  IoQueue& io() const { return *io_; }
  /// Every swap file of the registered stores.
  std::vector<std::string> files() const;
  bool started() const { return io_ != nullptr; }

 private:
  int rank_;
  std::deque<RunDir> dirs_;  // a deque: stores keep pointers to its elements
  std::map<std::string, size_t> dir_of_;
  std::vector<SwapStore*> stores_;
  std::vector<PinnedPool*> pools_;
  std::unique_ptr<IoQueue> io_;
  std::vector<std::function<void()>> quiesce_;
};

}  // namespace zeroshard::offload
