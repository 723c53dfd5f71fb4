#pragma once
// The memory ledger and the tracked buffers that feed it. Every byte the engine allocates goes
// through a Buffer, so memory() is exact rather than estimated.

#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <utility>

#include "zeroshard/memory.hpp"

namespace zeroshard {

class Ledger {
 public:
  /// `name` is listed in MemoryReport::buffers when kind is MemKind::buffer.
  void add(Tier tier, MemKind kind, const std::string& name, int64_t bytes);
  void sub(Tier tier, MemKind kind, const std::string& name, int64_t bytes);
  MemoryReport report() const;
  /// From now on Buffers registering here are counted and not allocated (their data() is null):
  /// a plan of what an engine would hold (src/planner/plan_memory.cpp).
  void count_only() { count_only_ = true; }
  bool counting_only() const { return count_only_; }

 private:
  bool count_only_ = false;
  mutable std::mutex mu_;
  MemoryReport r_;
  std::map<std::pair<std::string, int>, NamedBuffer> named_;
};

/// Memory Buffer takes from somewhere other than the host heap: the CUDA device tier, or host
/// memory page-locked through CUDA so the GPU copies it by DMA (src/compute.hpp).
class Allocator {
 public:
  virtual ~Allocator() = default;
  /// `bytes` (> 0) zero-filled bytes, aligned to at least 256; throws Error(no_space) naming
  /// `name` when they do not fit, Error(cuda_error) on another failure.
  virtual void* allocate(size_t bytes, const std::string& name) = 0;
  virtual void deallocate(void* p) noexcept = 0;
};

/// Move-only, zero-filled, aligned host memory counted in a Ledger for its lifetime. Buffers
/// of 1 MiB or more (except huge-page staging) are anonymous mappings whose pages take memory
/// when first written; the ledger counts their whole size from the start.
/// Tier::host buffers are page-locked (mlock) when `pin` is set, as the offload tier needs.
/// With `huge_pages` (I/O staging), buffers of 2 MiB or more are 2 MiB-aligned and backed by
/// transparent huge pages where the kernel allows.
class Buffer {
 public:
  Buffer() = default;
  Buffer(Ledger* ledger, Tier tier, MemKind kind, std::string name, size_t bytes, bool pin = false,
         bool huge_pages = false);
  /// From `alloc` instead (null: the host heap, as above, unpinned).
  Buffer(Ledger* ledger, Tier tier, MemKind kind, std::string name, size_t bytes, Allocator* alloc);
  ~Buffer();
  Buffer(Buffer&& o) noexcept { swap(o); }
  Buffer& operator=(Buffer&& o) noexcept {
    Buffer tmp(std::move(o));
    swap(tmp);
    return *this;
  }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;

  void* data() const { return data_; }
  size_t bytes() const { return bytes_; }
  template <class T>
  T* as() const {
    return static_cast<T*>(data_);
  }
  bool empty() const { return data_ == nullptr; }
  /// Faults every page in for writing, in one kernel call (Linux 5.14's MADV_POPULATE_WRITE;
  /// nothing where the kernel refuses it or the memory is not mapped zero pages): a large copy
  /// into a fresh buffer then runs at memory speed instead of one page trap per 4 KiB, which
  /// costs 3× the copy on the virtual machines measured (docs/checkpoints.md). With a range,
  /// the pages of [from, from + bytes) only (clamped to the buffer).
  void populate(size_t from = 0, size_t bytes = SIZE_MAX) noexcept;

 private:
  void swap(Buffer& o) noexcept;
  void* data_ = nullptr;
  size_t bytes_ = 0;
  size_t rounded_ = 0;  // bytes allocated (aligned up)
  Ledger* ledger_ = nullptr;
  Tier tier_ = Tier::device;
  MemKind kind_ = MemKind::buffer;
  bool pinned_ = false;
  bool mapped_ = false;  // mmap'd zero pages (munmap), else the heap (free)
  Allocator* alloc_ = nullptr;
  std::string name_;
};

/// Bytes held outside memory (swap files), charged to the ledger's nvme column for the lifetime
/// of the charge.
class DiskCharge {
 public:
  DiskCharge(Ledger* l, MemKind k, std::string name, int64_t bytes)
      : l_(l), k_(k), name_(std::move(name)), n_(bytes) {
    l_->add(Tier::nvme, k_, name_, n_);
  }
  ~DiskCharge() { l_->sub(Tier::nvme, k_, name_, n_); }
  DiskCharge(const DiskCharge&) = delete;
  DiskCharge& operator=(const DiskCharge&) = delete;

 private:
  Ledger* l_;
  MemKind k_;
  std::string name_;
  int64_t n_;
};

}  // namespace zeroshard
