#pragma once
// finalize() writes every unit's initial state to its swap file: the writes overlap, one per free
// slot of a staging pool, and the first failure is reported once all of them settled.

#include <deque>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "base/check.hpp"
#include "offload/io_queue.hpp"
#include "offload/pinned_pool.hpp"

namespace zeroshard::offload {

class InitialWrites {
 public:
  explicit InitialWrites(PinnedPool& pool) : pool_(pool) {}

  /// A free slot of the pool; when none is free, the oldest write gives its slot back.
  int slot(IoQueue& io) {
    int s = pool_.try_acquire();
    while (s < 0) {
      ZS_CHECK(!writes_.empty());
      settle(io, writes_.front());
      writes_.pop_front();
      s = pool_.try_acquire();
    }
    return s;
  }
  /// Writes the pieces (from `slot`), which is given back once the write settled.
  void submit(IoQueue& io, std::vector<Piece> pieces, std::string what, int slot) {
    writes_.push_back({io.submit(std::move(pieces), std::move(what)), slot});
  }
  /// Waits for every write; throws the first failure.
  void finish(IoQueue& io) {
    for (auto& w : writes_) settle(io, w);
    writes_.clear();
    if (failed_) {
      Error e = *failed_;
      failed_.reset();
      throw e;
    }
  }

 private:
  void settle(IoQueue& io, std::pair<std::shared_ptr<IoBatch>, int>& w) {
    io.settle(*w.first);
    if (!failed_) failed_ = w.first->error();
    pool_.release(w.second);
  }

  PinnedPool& pool_;
  std::deque<std::pair<std::shared_ptr<IoBatch>, int>> writes_;  // batch, slot
  std::optional<Error> failed_;
};

}  // namespace zeroshard::offload
