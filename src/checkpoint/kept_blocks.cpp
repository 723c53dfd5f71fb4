// Verified blocks kept between a load's two passes (kept_blocks.hpp).
#include "src/checkpoint/kept_blocks.hpp"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <fstream>
#include <functional>
#include <vector>

#include "src/base/check.hpp"
#include "src/base/ledger.hpp"
#include "zeroshard/communicator.hpp"

namespace zeroshard::ckpt {

namespace {

constexpr int64_t kHuge = int64_t(2) << 20;
constexpr int64_t kPage = 4096;  // O_DIRECT's alignment

// MemAvailable of /proc/meminfo in bytes (0 where it cannot be read: nothing is kept).
int64_t available_host_bytes() {
  std::ifstream in("/proc/meminfo");
  std::string key, unit;
  int64_t kib = 0;
  while (in >> key >> kib) {
    if (key == "MemAvailable:") return kib * 1024;
    std::getline(in, unit);
  }
  return 0;
}

}  // namespace

KeptBlocks::~KeptBlocks() {
  if (!base_) return;
  munmap(base_, size_t(mapped_));
  if (ledger_) ledger_->sub(Tier::host, MemKind::buffer, "checkpoint_load", mapped_);
}

void KeptBlocks::size_for(int64_t total) {
  ZS_CHECK(!base_ && mapped_ == 0);
  const int64_t want = std::min(budget_, total) / kPage * kPage;
  if (want <= 0) return;
  // Rounded to whole huge pages; the mapping's start is aligned by asking for one more and
  // trimming. Untouched pages cost nothing: the readers' toucher faults them in as it goes.
  const int64_t bytes = (want + kHuge - 1) / kHuge * kHuge;
  void* p = mmap(nullptr, size_t(bytes + kHuge), PROT_READ | PROT_WRITE,
                 MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED) return;  // no room: the blocks are read twice, as without a budget
  char* raw = static_cast<char*>(p);
  char* aligned = reinterpret_cast<char*>(
      (reinterpret_cast<uintptr_t>(raw) + uintptr_t(kHuge) - 1) & ~uintptr_t(kHuge - 1));
  if (aligned > raw) munmap(raw, size_t(aligned - raw));
  if (aligned + bytes < raw + bytes + kHuge)
    munmap(aligned + bytes, size_t(raw + bytes + kHuge - (aligned + bytes)));
  (void)madvise(aligned, size_t(bytes), MADV_HUGEPAGE);  // a hint: fine if refused
  base_ = aligned;
  mapped_ = bytes;
  if (ledger_) ledger_->add(Tier::host, MemKind::buffer, "checkpoint_load", mapped_);
}

char* KeptBlocks::keep(int s, int r, int64_t b, int64_t len) {
  const int64_t room = (len + kPage - 1) / kPage * kPage;  // the next block starts aligned
  if (!base_ || used_ + room > mapped_) return nullptr;
  const auto [it, added] = at_.emplace(std::make_tuple(s, r, b), used_);
  ZS_CHECK(added);
  used_ += room;
  return base_ + it->second;
}

const char* KeptBlocks::find(int s, int r, int64_t b) const {
  const auto it = at_.find({s, r, b});
  return it == at_.end() ? nullptr : base_ + it->second;
}

int64_t load_buffer_budget(Communicator& comm, int64_t setting, const std::string& what) {
  if (setting >= 0) return setting;
  // The ranks on this host, by a hash of its name: every rank puts its own in its slot.
  char host[256] = {};
  (void)gethostname(host, sizeof host - 1);
  const double mine = double(std::hash<std::string>{}(host) & ((uint64_t(1) << 52) - 1));
  std::vector<double> names(size_t(comm.size()), 0.0);
  names[size_t(comm.rank())] = mine;
  comm.all_reduce(names.data(), int64_t(names.size()), ReduceOp::sum, what + " (ranks per host)")
      ->wait();
  const int64_t here = std::count(names.begin(), names.end(), mine);
  return available_host_bytes() / 2 / std::max<int64_t>(here, 1);
}

}  // namespace zeroshard::ckpt
