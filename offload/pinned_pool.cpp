#include "offload/pinned_pool.hpp"

#include "base/check.hpp"

namespace zeroshard::offload {

PinnedPool::PinnedPool(Ledger* ledger, std::string name, int count, size_t bytes, bool pin)
    : name_(std::move(name)), bytes_((bytes + 4095) / 4096 * 4096) {
  ZS_CHECK(count >= 0);
  for (int i = 0; i < count && bytes_ > 0; ++i) {
    buffers_.emplace_back(ledger, Tier::host, MemKind::buffer, name_, bytes_, pin,
                          /*huge_pages=*/true);
    used_.push_back(false);
  }
}

int PinnedPool::try_acquire() {
  for (size_t i = 0; i < used_.size(); ++i)
    if (!used_[i]) {
      used_[i] = true;
      return int(i);
    }
  return -1;
}

void PinnedPool::release(int slot) {
  ZS_CHECK(slot >= 0 && size_t(slot) < used_.size() && used_[size_t(slot)]);
  used_[size_t(slot)] = false;
}

int PinnedPool::free_count() const {
  int n = 0;
  for (bool u : used_) n += !u;
  return n;
}

void PinnedPool::append_iovecs(std::vector<iovec>& out) {
  if (buffers_.empty()) return;
  reg_base_ = int(out.size());
  reg_per_buffer_ = int((bytes_ + kRegChunk - 1) / kRegChunk);
  for (const Buffer& b : buffers_)
    for (size_t off = 0; off < bytes_; off += kRegChunk)
      out.push_back({b.as<char>() + off, std::min(kRegChunk, bytes_ - off)});
}

int PinnedPool::buf_index(const char* p, size_t len) const {
  if (reg_base_ < 0) return -1;
  for (size_t i = 0; i < buffers_.size(); ++i) {
    const char* base = buffers_[i].as<char>();
    if (p < base || p + len > base + bytes_) continue;
    size_t first = size_t(p - base) / kRegChunk, last = (size_t(p - base) + len - 1) / kRegChunk;
    if (first != last) return -1;
    return reg_base_ + int(i) * reg_per_buffer_ + int(first);
  }
  return -1;
}

}  // namespace zeroshard::offload
