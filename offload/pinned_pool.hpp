#pragma once
// A fixed pool of equal page-locked host buffers: the staging memory of the NVMe tier (swap
// pipeline slots, gradient and parameter staging). Memory stays bounded by count × size,
// whatever the model, and every byte is in the Ledger as MemKind::buffer under the pool's name.
//
// The buffers are page-aligned (O_DIRECT needs aligned addresses; 2 MiB-aligned on transparent
// huge pages when at least that big, so requests are few DMA segments) and mlock-ed, so the
// io_uring swapper can register them once as fixed buffers; a CUDA build would also
// cudaHostRegister them so device copies from them are asynchronous (not wired in: this tree has no
// CUDA copy path).

#include <sys/uio.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "base/ledger.hpp"

namespace zeroshard::offload {

class PinnedPool {
 public:
  PinnedPool() = default;
  /// `count` buffers of `bytes` each (rounded up to 4096), Tier::host, named `name` in the ledger.
  PinnedPool(Ledger* ledger, std::string name, int count, size_t bytes, bool pin);
  PinnedPool(PinnedPool&&) noexcept = default;
  PinnedPool& operator=(PinnedPool&&) noexcept = default;

  int count() const { return int(buffers_.size()); }
  size_t bytes() const { return bytes_; }
  char* data(int slot) const { return buffers_[size_t(slot)].as<char>(); }
  const std::string& name() const { return name_; }

  /// A free slot (now taken), or -1 when every slot is in use.
  int try_acquire();
  void release(int slot);
  int free_count() const;
  bool in_use(int slot) const { return used_[size_t(slot)]; }

  /// io_uring registers at most 1 GiB per fixed buffer, so each buffer is registered as
  /// `kRegChunk` pieces. Appends them to `out` and remembers where they start in the table.
  void append_iovecs(std::vector<iovec>& out);
  /// Index of the registered buffer holding [p, p + len), or -1 when the range straddles two
  /// registration pieces or the pool is not registered (the I/O then goes unregistered).
  int buf_index(const char* p, size_t len) const;

  static constexpr size_t kRegChunk = size_t(512) << 20;

 private:
  std::string name_;
  size_t bytes_ = 0;
  std::vector<Buffer> buffers_;
  std::vector<bool> used_;
  int reg_base_ = -1;  // index of buffer 0's first piece in the registered table
  int reg_per_buffer_ = 0;
};

}  // namespace zeroshard::offload
