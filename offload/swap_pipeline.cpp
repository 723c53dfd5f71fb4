#include "offload/swap_pipeline.hpp"

#include <algorithm>
#include <deque>

#include "base/check.hpp"

namespace zeroshard::offload {

PipelineResult run_pipeline(IoQueue& io, PinnedPool& pool, int n, int read_ahead,
                            const PipelineHooks& hooks) {
  struct Item {
    int slot = -1;
    std::vector<std::shared_ptr<IoBatch>> reads, writes;
  };
  std::vector<Item> items(size_t(std::max(n, 0)));
  std::deque<int> writing;  // units whose write-back holds their slot, oldest first
  PipelineResult out;
  auto note = [&](const std::shared_ptr<IoBatch>& b) {
    if (!out.error) out.error = b->error();
  };
  // Returns the slots of finished write-backs; with `block`, waits for the oldest first.
  auto reclaim = [&](bool block) {
    while (!writing.empty()) {
      Item& it = items[size_t(writing.front())];
      bool done = true;
      for (auto& w : it.writes) done = done && w->done();
      if (!done && !block) return;
      for (auto& w : it.writes) {
        io.settle(*w);
        note(w);
      }
      pool.release(it.slot);
      it.slot = -1;
      writing.pop_front();
      block = false;
    }
  };

  int next_read = 0;
  try {
    for (int k = 0; k < n && !out.error; ++k) {
      // Read ahead while slots allow; unit k itself must get one, waiting for a write if needed.
      while (next_read < n && next_read <= k + read_ahead) {
        int slot = pool.try_acquire();
        if (slot < 0) {
          if (next_read > k) break;
          ZS_CHECK(!writing.empty());  // every slot is either read ahead (> k) or being written
          reclaim(true);
          continue;
        }
        items[size_t(next_read)].slot = slot;
        items[size_t(next_read)].reads = hooks.read(next_read, slot);
        ++next_read;
      }
      Item& it = items[size_t(k)];
      for (auto& r : it.reads) {
        io.settle(*r);
        note(r);
      }
      if (out.error) break;
      hooks.update(k, it.slot);
      out.updated = k + 1;
      it.writes = hooks.write(k, it.slot);
      writing.push_back(k);
      reclaim(false);
    }
  } catch (const Error& e) {
    if (!out.error) out.error = e;
  }
  // Drain: units that hold a slot but are not being written (read ahead of a failure).
  for (int i = 0; i < next_read; ++i) {
    Item& it = items[size_t(i)];
    if (it.slot < 0 || std::find(writing.begin(), writing.end(), i) != writing.end()) continue;
    for (auto& r : it.reads) io.settle(*r);
    pool.release(it.slot);
    it.slot = -1;
  }
  while (!writing.empty()) reclaim(true);
  return out;
}

}  // namespace zeroshard::offload
