#pragma once
// A caching allocator for a stream-ordered device's memory (device memory or pinned host memory):
// blocks freed by their owner go to a per-size-class free list and are handed out again, so
// after the first step the step path never calls the device's allocator (cudaMalloc
// synchronises the device and can take milliseconds).
//
// Stream-ordered reuse: a block allocated for stream S may be freed while S still has work that
// uses it queued. The allocator then records an event on S at free time and hands the block to
// another stream only once that event has completed; the same stream S may reuse it at once,
// because S's own order puts the new work after the old.
//
// Every byte is reported (stats()): what is held from the backend, what is in use, and the peaks
// of both, so the engine's ledger can count this tier exactly.
//
// The bookkeeping here calls no device API: the Backend does (src/cuda/caching_allocator.cpp for
// CUDA), so that the bookkeeping is tested on the CPU (tests/unit/test_caching_allocator.cpp).

#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

namespace zeroshard {

class CachingAllocator : public std::enable_shared_from_this<CachingAllocator> {
 public:
  enum class Kind { device, pinned_host };

  /// What the allocator asks of the device. Streams and events are opaque handles.
  class Backend {
   public:
    virtual ~Backend() = default;
    /// `bytes` bytes (256-byte aligned), or null when the device is out of memory (any other
    /// failure throws Error).
    virtual void* alloc(size_t bytes) = 0;
    /// Frees `p`, waiting for the device if it must. Never throws.
    virtual void free(void* p) noexcept = 0;
    /// A new event, or null if none can be made (the block is then freed instead of cached).
    virtual void* new_event() noexcept = 0;
    virtual void delete_event(void* e) noexcept = 0;
    /// Marks the work queued on `stream` so far; false if it cannot.
    virtual bool record(void* e, void* stream) noexcept = 0;
    /// Whether the marked work is done; throws Error if it failed.
    virtual bool done(void* e) = 0;
    /// Waits for the marked work. Never throws.
    virtual void wait(void* e) noexcept = 0;
  };

  struct Stats {
    size_t reserved_bytes = 0;  ///< held from the backend (in use + cached)
    size_t in_use_bytes = 0;    ///< in blocks handed out (class sizes, not the requests)
    size_t peak_reserved_bytes = 0;
    size_t peak_in_use_bytes = 0;
    uint64_t backend_allocations = 0;  ///< Backend::alloc calls that succeeded
    uint64_t cache_hits = 0;           ///< allocations served from the cache
  };

  /// An allocated block; returns itself to the allocator when destroyed (never throws). The
  /// allocator stays alive while any block does.
  class Block {
   public:
    Block() = default;
    ~Block();
    Block(Block&& o) noexcept;
    Block& operator=(Block&& o) noexcept;
    Block(const Block&) = delete;
    Block& operator=(const Block&) = delete;

    void* data() const { return ptr_; }
    template <class T>
    T* as() const {
      return static_cast<T*>(ptr_);
    }
    size_t bytes() const { return bytes_; }  ///< the class size, ≥ the requested size
    /// Returns the block now (as destruction would).
    void reset() noexcept;

   private:
    friend class CachingAllocator;
    std::shared_ptr<CachingAllocator> owner_;
    void* ptr_ = nullptr;
    size_t bytes_ = 0;
    void* stream_ = nullptr;
  };

  /// An allocator of `kind` memory of `device` (for messages) over `backend`. Always held by
  /// shared_ptr: blocks keep it alive.
  static std::shared_ptr<CachingAllocator> create(Kind kind, int device,
                                                  std::unique_ptr<Backend> backend);
  ~CachingAllocator();
  CachingAllocator(const CachingAllocator&) = delete;
  CachingAllocator& operator=(const CachingAllocator&) = delete;

  /// A block of at least `bytes` bytes (256-byte aligned) to be used on `stream` (nullptr: the
  /// caller orders every use itself). Throws Error(no_space) if the backend cannot provide the
  /// memory even after the cache is emptied, Error on other backend failures.
  Block allocate(size_t bytes, void* stream = nullptr);
  /// Allocates `count` blocks of `bytes` and caches them: a warm-up that moves the backend's
  /// allocations out of the first step.
  void reserve(size_t bytes, int count = 1);
  /// Frees every cached block, waiting for each one's last use first. Never throws.
  void release_cached() noexcept;
  Stats stats() const;
  /// One line: "device allocator (device 0): 12.0 MiB reserved, 8.0 MiB in use, ...".
  std::string report() const;

  /// The size a request of `bytes` is rounded to: powers of two from 512 B up to 1 MiB, then
  /// multiples of 2 MiB (at most 2 MiB or 2× waste per block, few classes to reuse across).
  static size_t class_size(size_t bytes);

 private:
  CachingAllocator(Kind kind, int device, std::unique_ptr<Backend> backend)
      : kind_(kind), device_(device), backend_(std::move(backend)) {}
  struct Cached {
    void* ptr;
    void* stream;  // the stream of its last use
    void* ready;   // event recorded at free on that stream; null when no stream was given
  };
  const char* kind_name() const { return kind_ == Kind::device ? "device" : "pinned host"; }
  void give_back(void* ptr, size_t bytes, void* stream) noexcept;
  void* backend_alloc(size_t bytes);
  void release_cached_locked() noexcept;
  void* take_event() noexcept;
  void give_event(void* e) noexcept;

  const Kind kind_;
  const int device_;
  std::unique_ptr<Backend> backend_;
  mutable std::mutex mu_;
  std::unordered_map<size_t, std::vector<Cached>> free_;
  std::vector<void*> spare_events_;
  Stats stats_;
};

}  // namespace zeroshard
