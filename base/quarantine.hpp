#pragma once
// Quarantine: the owner of memory that a backend may still write into after its user gave up on
// it (a collective that timed out may complete when a late peer arrives; a GPU collective may
// still wait behind a stream the trainer blocked). Freeing such memory, or handing it to the
// next call, would let the late write land in someone else's data; cudaFree on it would wait
// for the device, perhaps forever. So the memory is parked here with a test of whether the
// backend is done with it, and freed by reap() as soon as that test passes.
//
// Bounded: entries come only from collectives that failed, and a communicator refuses new
// collectives once one failed, so a quarantine holds at most the collectives that were in
// flight at that failure. Entries still unsettled when the quarantine itself is destroyed (its
// communicator is gone and no later reap() can come) are the one deliberate leak left: they are
// kept until the process ends, counted in a line on stderr, because no point before that is
// known to be safe.

#include <cstdio>
#include <functional>
#include <memory>
#include <mutex>
#include <vector>

namespace zeroshard {

class Quarantine {
 public:
  Quarantine() = default;
  Quarantine(const Quarantine&) = delete;
  Quarantine& operator=(const Quarantine&) = delete;
  ~Quarantine() {
    reap();
    if (entries_.empty()) return;
    std::fprintf(stderr,
                 "zeroshard: %zu buffer set(s) of failed collectives are still in use by their "
                 "backend at teardown; they are kept until the process ends\n",
                 entries_.size());
    // The deliberate, bounded leak described above. (If even this allocation fails, the entries
    // are freed here: nothing better is left.)
    (void)new (std::nothrow) std::vector<Entry>(std::move(entries_));
  }

  /// Keeps `payload` alive until `settled()` returns true (it must not throw, and is called with
  /// the quarantine's lock held). Reaps the entries already settled first. Never throws: if the
  /// entry cannot be recorded, the payload is kept until the process ends instead.
  void park(std::function<bool()> settled, std::shared_ptr<void> payload) noexcept {
    reap();
    std::lock_guard<std::mutex> lock(mu_);
    try {
      // Room first: once the entry is built from the payload nothing may throw, or a temporary
      // would free the payload under its late writer.
      entries_.reserve(entries_.size() + 1);
      entries_.push_back({std::move(settled), std::move(payload)});
    } catch (...) {
      (void)new (std::nothrow) std::shared_ptr<void>(std::move(payload));
    }
  }

  /// Frees every payload whose backend is done with it; returns how many are left.
  size_t reap() noexcept {
    std::lock_guard<std::mutex> lock(mu_);
    std::erase_if(entries_, [](const Entry& e) { return e.settled(); });
    return entries_.size();
  }

 private:
  struct Entry {
    std::function<bool()> settled;
    std::shared_ptr<void> payload;
  };
  std::mutex mu_;
  std::vector<Entry> entries_;
};

}  // namespace zeroshard
