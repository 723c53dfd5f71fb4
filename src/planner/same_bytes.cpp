// The same-bytes pass (include/zeroshard/calibration.hpp): cpu::same_bytes on the engine's
// chunking, with streams of each element width moved by one kernel call per chunk.
#include <chrono>
#include <map>
#include <string>

#include "base/check.hpp"
#include "kernels/cpu/arena.hpp"
#include "kernels/cpu/cpu_kernels.hpp"
#include "zeroshard/calibration.hpp"

namespace zeroshard {

namespace {
constexpr size_t kMaxStreams = 8;  // per call of the kernel (kernels/cpu/kernel_table.hpp)
}

struct SameBytesPass::Impl {
  explicit Impl(int threads) : arena(threads) {}
  cpu::Arena arena;
};

SameBytesPass::SameBytesPass(int threads) : impl_(std::make_unique<Impl>(threads)) {}
SameBytesPass::~SameBytesPass() = default;
int SameBytesPass::threads() const {
  return impl_->arena.threads();
}
const char* SameBytesPass::isa() const {
  return cpu::isa_name(impl_->arena.isa());
}

double SameBytesPass::run(const std::vector<MemoryStream>& reads,
                          const std::vector<MemoryStream>& writes, int64_t n) {
  struct Group {
    std::vector<const float*> reads;
    std::vector<float*> writes;
  };
  std::map<int, Group> groups;  // by element width
  auto check = [&](const MemoryStream& s, const char* which) {
    if (n < 0 || (n > 0 && !s.data) || s.element_bytes <= 0 || s.element_bytes % 2 != 0)
      ZS_THROW(invalid_argument, "SameBytesPass::run(): a "
                                     << which << " stream of " << s.element_bytes
                                     << "-byte elements at " << s.data << " (n = " << n << ")");
  };
  for (const MemoryStream& s : reads) {
    check(s, "read");
    groups[s.element_bytes].reads.push_back(static_cast<const float*>(s.data));
  }
  for (const MemoryStream& s : writes) {
    check(s, "write");
    groups[s.element_bytes].writes.push_back(static_cast<float*>(s.data));
  }
  for (auto& [width, g] : groups) {
    // The kernel writes what it read: reads of a width with nothing written would be dropped.
    if (g.writes.empty())
      ZS_THROW(invalid_argument, "SameBytesPass::run(): " << g.reads.size() << " read stream(s) of "
                                                          << width
                                                          << "-byte elements and no "
                                                             "write stream of that width: give "
                                                             "the pass one (their reads would "
                                                             "be optimised away)");
    if (g.reads.size() > kMaxStreams || g.writes.size() > kMaxStreams)
      ZS_THROW(invalid_argument, "SameBytesPass::run(): " << g.reads.size() << " read and "
                                                          << g.writes.size() << " write streams of "
                                                          << width << "-byte elements; at most "
                                                          << kMaxStreams << " of each per width");
  }
  cpu::Arena& arena = impl_->arena;
  const cpu::Isa isa = arena.isa();
  const auto t0 = std::chrono::steady_clock::now();
  arena.parallel_chunks(n, [&](int64_t b, int64_t e) {
    for (auto& [width, g] : groups) {
      // In 4-byte words: chunks start at multiples of 64 Ki elements, so only a stream's last
      // chunk can round down.
      const int64_t w0 = b * width / 4, w1 = e * width / 4;
      const float* r[kMaxStreams];
      float* w[kMaxStreams];
      for (size_t i = 0; i < g.reads.size(); ++i) r[i] = g.reads[i] + w0;
      for (size_t i = 0; i < g.writes.size(); ++i) w[i] = g.writes[i] + w0;
      cpu::same_bytes(isa, r, int(g.reads.size()), w, int(g.writes.size()), w1 - w0);
    }
  });
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace zeroshard
