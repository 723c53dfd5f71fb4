// The caching allocator's bookkeeping (see caching_allocator.hpp): size classes, the free
// lists, the events that keep a block from another stream until its last use is done, stats.
#include "src/compute/caching_allocator.hpp"

#include <algorithm>
#include <bit>
#include <sstream>
#include <utility>

#include "base/check.hpp"

namespace zeroshard {
namespace {

constexpr size_t kMinClass = 512;
constexpr size_t kSmallLimit = size_t{1} << 20;
constexpr size_t kLargeGrain = size_t{2} << 20;

std::string mib(size_t bytes) {
  std::ostringstream os;
  os.precision(1);
  os << std::fixed << double(bytes) / double(1 << 20) << " MiB";
  return os.str();
}

}  // namespace

// ---- Block ----------------------------------------------------------------------------------

CachingAllocator::Block::~Block() {
  reset();
}

CachingAllocator::Block::Block(Block&& o) noexcept
    : owner_(std::move(o.owner_)),
      ptr_(std::exchange(o.ptr_, nullptr)),
      bytes_(std::exchange(o.bytes_, 0)),
      stream_(std::exchange(o.stream_, nullptr)) {}

CachingAllocator::Block& CachingAllocator::Block::operator=(Block&& o) noexcept {
  if (this != &o) {
    reset();
    owner_ = std::move(o.owner_);
    ptr_ = std::exchange(o.ptr_, nullptr);
    bytes_ = std::exchange(o.bytes_, 0);
    stream_ = std::exchange(o.stream_, nullptr);
  }
  return *this;
}

void CachingAllocator::Block::reset() noexcept {
  if (ptr_ && owner_) owner_->give_back(ptr_, bytes_, stream_);
  ptr_ = nullptr;
  bytes_ = 0;
  owner_.reset();
}

// ---- CachingAllocator -----------------------------------------------------------------------

std::shared_ptr<CachingAllocator> CachingAllocator::create(Kind kind, int device,
                                                           std::unique_ptr<Backend> backend) {
  ZS_CHECK(backend != nullptr);
  return std::shared_ptr<CachingAllocator>(new CachingAllocator(kind, device, std::move(backend)));
}

CachingAllocator::~CachingAllocator() {
  // No block is outstanding (each holds a reference), so everything cached can go.
  std::lock_guard<std::mutex> lock(mu_);
  release_cached_locked();
  for (void* e : spare_events_) backend_->delete_event(e);
}

// Few classes make reuse likely across steps whose requests vary slightly in size.
size_t CachingAllocator::class_size(size_t bytes) {
  if (bytes <= kMinClass) return kMinClass;
  if (bytes <= kSmallLimit) return std::bit_ceil(bytes);
  return (bytes + kLargeGrain - 1) / kLargeGrain * kLargeGrain;
}

void* CachingAllocator::take_event() noexcept {
  if (!spare_events_.empty()) {
    void* e = spare_events_.back();
    spare_events_.pop_back();
    return e;
  }
  return backend_->new_event();
}

void CachingAllocator::give_event(void* e) noexcept {
  if (!e) return;
  try {
    spare_events_.push_back(e);
  } catch (...) {
    backend_->delete_event(e);  // out of host memory for the list
  }
}

void* CachingAllocator::backend_alloc(size_t bytes) {
  void* p = backend_->alloc(bytes);
  if (!p) {
    // Out of memory: give the cache back to the device and try once more before failing.
    release_cached_locked();
    p = backend_->alloc(bytes);
    if (!p)
      ZS_THROW(no_space, kind_name() << " allocator (device " << device_ << "): cannot allocate "
                                     << bytes << " bytes; " << stats_.in_use_bytes
                                     << " bytes in use, " << stats_.reserved_bytes << " reserved");
  }
  ++stats_.backend_allocations;
  stats_.reserved_bytes += bytes;
  stats_.peak_reserved_bytes = std::max(stats_.peak_reserved_bytes, stats_.reserved_bytes);
  return p;
}

CachingAllocator::Block CachingAllocator::allocate(size_t bytes, void* stream) {
  const size_t size = class_size(bytes);
  std::lock_guard<std::mutex> lock(mu_);
  Block b;
  auto it = free_.find(size);
  if (it != free_.end()) {
    // A cached block is usable if its last use is on the same stream (stream order protects it)
    // or has completed.
    auto& list = it->second;
    for (size_t i = 0; i < list.size(); ++i) {
      Cached& c = list[i];
      const bool ready = c.ready == nullptr || (stream != nullptr && c.stream == stream) ||
                         backend_->done(c.ready);
      if (!ready) continue;
      b.ptr_ = c.ptr;
      give_event(c.ready);
      list[i] = list.back();
      list.pop_back();
      ++stats_.cache_hits;
      break;
    }
  }
  if (!b.ptr_) b.ptr_ = backend_alloc(size);
  b.bytes_ = size;
  b.stream_ = stream;
  b.owner_ = shared_from_this();
  stats_.in_use_bytes += size;
  stats_.peak_in_use_bytes = std::max(stats_.peak_in_use_bytes, stats_.in_use_bytes);
  return b;
}

void CachingAllocator::give_back(void* ptr, size_t bytes, void* stream) noexcept {
  std::lock_guard<std::mutex> lock(mu_);
  stats_.in_use_bytes -= bytes;
  Cached c{ptr, stream, nullptr};
  if (stream != nullptr) {
    // Capture the work queued on the block's stream so far; until it completes the block goes
    // only to the same stream.
    void* e = take_event();
    if (e == nullptr || !backend_->record(e, stream)) {
      // Cannot track the last use (the device is failing or shutting down): free the block;
      // the backend's free waits for the device, so nothing still using it can be hurt.
      give_event(e);
      backend_->free(ptr);
      stats_.reserved_bytes -= bytes;
      return;
    }
    c.ready = e;
  }
  try {
    free_[bytes].push_back(c);
  } catch (...) {
    // Out of host memory for the free list: return the block to the device instead.
    if (c.ready) {
      backend_->wait(c.ready);
      give_event(c.ready);
    }
    backend_->free(ptr);
    stats_.reserved_bytes -= bytes;
  }
}

void CachingAllocator::reserve(size_t bytes, int count) {
  std::vector<Block> blocks;
  for (int i = 0; i < count; ++i) {
    // Fresh blocks only: a reservation should add capacity, not recycle what is cached.
    std::lock_guard<std::mutex> lock(mu_);
    Block b;
    b.bytes_ = class_size(bytes);
    b.ptr_ = backend_alloc(b.bytes_);
    b.owner_ = shared_from_this();
    stats_.in_use_bytes += b.bytes_;
    blocks.push_back(std::move(b));
  }
  // Destroying them puts them in the cache.
}

void CachingAllocator::release_cached_locked() noexcept {
  for (auto& [size, list] : free_) {
    for (Cached& c : list) {
      // Wait for the last use before handing the memory back to the device.
      if (c.ready != nullptr) {
        backend_->wait(c.ready);
        give_event(c.ready);
      }
      backend_->free(c.ptr);
      stats_.reserved_bytes -= size;
    }
  }
  free_.clear();
}

void CachingAllocator::release_cached() noexcept {
  std::lock_guard<std::mutex> lock(mu_);
  release_cached_locked();
}

CachingAllocator::Stats CachingAllocator::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  return stats_;
}

std::string CachingAllocator::report() const {
  const Stats s = stats();
  std::ostringstream os;
  os << kind_name() << " allocator (device " << device_ << "): " << mib(s.reserved_bytes)
     << " reserved, " << mib(s.in_use_bytes) << " in use, peaks " << mib(s.peak_reserved_bytes)
     << " / " << mib(s.peak_in_use_bytes) << ", " << s.backend_allocations
     << " device allocations, " << s.cache_hits << " cache hits";
  return os.str();
}

}  // namespace zeroshard
