#include "base/ledger.hpp"

#include <sys/mman.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <iomanip>
#include <sstream>

#include "base/check.hpp"

namespace zeroshard {

int64_t MemoryReport::total(Tier t) const {
  int64_t s = 0;
  for (int64_t b : bytes[int(t)]) s += b;
  return s;
}

int64_t MemoryReport::total() const {
  int64_t s = 0;
  for (int t = 0; t < kNumTiers; ++t) s += total(Tier(t));
  return s;
}

int64_t MemoryReport::model_state_bytes() const {
  int64_t s = 0;
  for (int t = 0; t < kNumTiers; ++t)
    for (int k = 0; k < int(MemKind::buffer); ++k) s += bytes[t][k];
  return s;
}

std::string MemoryReport::to_string() const {
  std::ostringstream os;
  auto mib = [](int64_t b) {
    std::ostringstream s;
    s << std::fixed << std::setprecision(2) << double(b) / (1 << 20);
    return s.str();
  };
  os << std::left << std::setw(14) << "MiB" << std::right;
  for (int t = 0; t < kNumTiers; ++t) os << std::setw(12) << tier_name(Tier(t));
  os << std::setw(12) << "peak" << '\n';
  for (int k = 0; k < kNumMemKinds; ++k) {
    os << std::left << std::setw(14) << mem_kind_name(MemKind(k)) << std::right;
    int64_t pk = 0;
    for (int t = 0; t < kNumTiers; ++t) {
      os << std::setw(12) << mib(bytes[t][k]);
      pk += peak[t][k];
    }
    os << std::setw(12) << mib(pk) << '\n';
  }
  os << std::left << std::setw(14) << "total" << std::right;
  for (int t = 0; t < kNumTiers; ++t) os << std::setw(12) << mib(total(Tier(t)));
  os << '\n';
  for (const NamedBuffer& b : buffers)
    os << "  buffer " << std::left << std::setw(16) << b.name << std::right << std::setw(8)
       << tier_name(b.tier) << std::setw(12) << mib(b.bytes) << " MiB (peak " << mib(b.peak)
       << ")\n";
  return os.str();
}

void Ledger::add(Tier tier, MemKind kind, const std::string& name, int64_t n) {
  std::lock_guard<std::mutex> lock(mu_);
  int64_t& cur = r_.bytes[int(tier)][int(kind)];
  cur += n;
  int64_t& pk = r_.peak[int(tier)][int(kind)];
  if (cur > pk) pk = cur;
  if (kind == MemKind::buffer) {
    NamedBuffer& b = named_[{name, int(tier)}];
    b.name = name;
    b.tier = tier;
    b.bytes += n;
    if (b.bytes > b.peak) b.peak = b.bytes;
  }
}

void Ledger::sub(Tier tier, MemKind kind, const std::string& name, int64_t n) {
  std::lock_guard<std::mutex> lock(mu_);
  r_.bytes[int(tier)][int(kind)] -= n;
  if (kind == MemKind::buffer) named_[{name, int(tier)}].bytes -= n;
}

MemoryReport Ledger::report() const {
  std::lock_guard<std::mutex> lock(mu_);
  MemoryReport r = r_;
  for (const auto& [key, b] : named_) r.buffers.push_back(b);
  return r;
}

// Page alignment suits O_DIRECT I/O, registration with CUDA, and SIMD loads alike.
static constexpr size_t kAlign = 4096;

// I/O staging buffers (`huge`) of 2 MiB or more are backed by transparent huge pages where the
// kernel allows it: an I/O request then spans a few physically contiguous segments instead of
// one per 4 KiB page (a 1 MiB request would exceed virtio-blk's 254 segments and be split), and
// DMA and the CPU kernels take fewer TLB misses. Only staging asks for it: rounding up to 2 MiB
// is nothing for a few slots but would be for thousands of mid-sized state buffers.
static constexpr size_t kHugeAlign = size_t(2) << 20;
// Buffers of at least this size are mapped zero pages of their own (see the constructor).
static constexpr size_t kMapped = size_t(1) << 20;

Buffer::Buffer(Ledger* ledger, Tier tier, MemKind kind, std::string name, size_t bytes, bool pin,
               bool huge_pages)
    : ledger_(ledger), tier_(tier), kind_(kind), name_(std::move(name)) {
  if (bytes == 0) return;
  if (ledger_ && ledger_->counting_only()) {  // a plan: counted, never allocated
    bytes_ = bytes;
    ledger_->add(tier_, kind_, name_, int64_t(bytes_));
    return;
  }
  const bool huge = huge_pages && bytes >= kHugeAlign;
  const size_t align = huge ? kHugeAlign : kAlign;
  size_t rounded = (bytes + align - 1) / align * align;
  if (!huge && rounded >= kMapped) {
    // Fresh anonymous pages read as zeros and take memory only when first written: the state
    // a finalize() allocates grows as it is filled, unit by unit, and the moments and gradients
    // only when a step first writes them (so a trainer's own copy of the model, freed after
    // finalize(), and the engine's untouched buffers never peak together).
    void* p = mmap(nullptr, rounded, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) ZS_THROW(no_space, "cannot map " << bytes << " bytes for " << name_);
    data_ = p;
    mapped_ = true;
  } else {
    data_ = std::aligned_alloc(align, rounded);
    if (!data_) ZS_THROW(no_space, "cannot allocate " << bytes << " bytes for " << name_);
    if (huge) (void)madvise(data_, rounded, MADV_HUGEPAGE);  // a hint: fine if refused
    std::memset(data_, 0, rounded);
  }
  bytes_ = bytes;
  // Pinning can fail under RLIMIT_MEMLOCK; the buffer then stays pageable and still works.
  if (pin && tier == Tier::host) pinned_ = mlock(data_, rounded) == 0;
  rounded_ = rounded;
  if (ledger_) ledger_->add(tier_, kind_, name_, int64_t(bytes_));
}

void Buffer::populate(size_t from, size_t bytes) noexcept {
#ifdef MADV_POPULATE_WRITE
  if (!mapped_ || from >= rounded_) return;
  // madvise takes a page-aligned start; the mapping itself is.
  const size_t page = size_t(sysconf(_SC_PAGESIZE));
  const size_t begin = from / page * page;
  const size_t end = bytes >= rounded_ - from ? rounded_ : from + bytes;
  (void)madvise(static_cast<char*>(data_) + begin, end - begin,
                MADV_POPULATE_WRITE);  // a hint: fine if refused
#else
  (void)from;
  (void)bytes;
#endif
}

Buffer::Buffer(Ledger* ledger, Tier tier, MemKind kind, std::string name, size_t bytes,
               Allocator* alloc)
    : Buffer(alloc ? nullptr : ledger, tier, kind, std::move(name), alloc ? 0 : bytes) {
  if (!alloc || bytes == 0) return;
  ledger_ = ledger;
  if (ledger_ && ledger_->counting_only()) {  // a plan: counted, never allocated
    bytes_ = bytes;
    ledger_->add(tier_, kind_, name_, int64_t(bytes_));
    return;
  }
  data_ = alloc->allocate(bytes, name_);
  alloc_ = alloc;
  bytes_ = rounded_ = bytes;
  if (ledger_) ledger_->add(tier_, kind_, name_, int64_t(bytes_));
}

Buffer::~Buffer() {
  if (data_ && alloc_) {
    alloc_->deallocate(data_);
  } else if (data_) {
    if (pinned_) munlock(data_, rounded_);
    if (mapped_)
      munmap(data_, rounded_);
    else
      std::free(data_);
  }
  if (ledger_ && bytes_) ledger_->sub(tier_, kind_, name_, int64_t(bytes_));
}

void Buffer::swap(Buffer& o) noexcept {
  std::swap(data_, o.data_);
  std::swap(bytes_, o.bytes_);
  std::swap(ledger_, o.ledger_);
  std::swap(tier_, o.tier_);
  std::swap(kind_, o.kind_);
  std::swap(pinned_, o.pinned_);
  std::swap(mapped_, o.mapped_);
  std::swap(rounded_, o.rounded_);
  std::swap(alloc_, o.alloc_);
  std::swap(name_, o.name_);
}

}  // namespace zeroshard
