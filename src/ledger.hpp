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

 private:
  mutable std::mutex mu_;
  MemoryReport r_;
  std::map<std::pair<std::string, int>, NamedBuffer> named_;
};

/// Move-only, zero-filled, aligned host memory counted in a Ledger for its lifetime.
/// Tier::host buffers are page-locked (mlock) when `pin` is set, as the offload tier needs.
/// With `huge_pages` (I/O staging), buffers of 2 MiB or more are 2 MiB-aligned and backed by
/// transparent huge pages where the kernel allows.
class Buffer {
 public:
  Buffer() = default;
  Buffer(Ledger* ledger, Tier tier, MemKind kind, std::string name, size_t bytes, bool pin = false,
         bool huge_pages = false);
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

 private:
  void swap(Buffer& o) noexcept;
  void* data_ = nullptr;
  size_t bytes_ = 0;
  size_t rounded_ = 0;  // bytes allocated (aligned up)
  Ledger* ledger_ = nullptr;
  Tier tier_ = Tier::device;
  MemKind kind_ = MemKind::buffer;
  bool pinned_ = false;
  std::string name_;
};

}  // namespace zeroshard
