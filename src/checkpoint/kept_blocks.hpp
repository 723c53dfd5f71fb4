#pragma once
// A load reads every block twice unless it keeps what it verified: its first pass checks every
// block before any state changes (a failed load leaves the engine as it was), and its second
// writes the state. KeptBlocks holds the first pass's verified blocks in memory, up to a budget,
// so that the second pass copies them instead of reading the disk again: with the whole read
// kept the disk is read once. Blocks past the budget are read again, as before.
#include <cstdint>
#include <map>
#include <string>
#include <tuple>

namespace zeroshard {
class Communicator;
class Ledger;
}  // namespace zeroshard

namespace zeroshard::ckpt {

class KeptBlocks {
 public:
  /// Keeps up to `budget` bytes (0: none), counted in `ledger` (may be null) as the host buffer
  /// "checkpoint_load" while they are held. Memory is taken by size_for(), not here.
  KeptBlocks(int64_t budget, Ledger* ledger) : budget_(budget), ledger_(ledger) {}
  ~KeptBlocks();
  KeptBlocks(const KeptBlocks&) = delete;
  KeptBlocks& operator=(const KeptBlocks&) = delete;

  /// Maps min(budget, `total`) bytes (2 MiB-aligned, transparent huge pages where the kernel
  /// allows; pages are faulted in by whoever first writes them). Once, before keep().
  void size_for(int64_t total);
  /// Room for block b of rank r's file of state s (`len` bytes, 4096-aligned start), or null
  /// when the rest of the budget is too small: the blocks kept are the first ones asked for.
  char* keep(int s, int r, int64_t b, int64_t len);
  /// The block kept by keep(), verified since; null if it was not kept.
  const char* find(int s, int r, int64_t b) const;
  int64_t bytes() const { return mapped_; }

 private:
  int64_t budget_;
  Ledger* ledger_;
  char* base_ = nullptr;
  int64_t mapped_ = 0, used_ = 0;
  std::map<std::tuple<int, int, int64_t>, int64_t> at_;  // (state, rank, block) → offset
};

/// The bytes of verified blocks a load on this rank may keep, from
/// Config::checkpoint_load_buffer_bytes: that many if >= 0; if -1, half of the host memory the
/// kernel reports available (MemAvailable) shared among the ranks on this host (counted by host
/// name: collective). `what` names the load in a failed collective's error.
int64_t load_buffer_budget(Communicator& comm, int64_t setting, const std::string& what);

}  // namespace zeroshard::ckpt
