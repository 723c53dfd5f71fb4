// Muon's exchange as rounds of point-to-point pieces (the contract is in muon_exchange.hpp).
#include "src/muon_exchange.hpp"

#include <algorithm>

#include "base/check.hpp"

namespace zeroshard {

std::vector<MuonRound> muon_rounds(const std::vector<MuonSpan>& mats, int ranks, int64_t shard) {
  ZS_CHECK(ranks >= 1 && shard >= 0);
  std::vector<std::vector<int>> owned(static_cast<size_t>(ranks));
  for (size_t i = 0; i < mats.size(); ++i) {
    ZS_CHECK(mats[i].owner >= 0 && mats[i].owner < ranks && mats[i].numel > 0);
    owned[size_t(mats[i].owner)].push_back(int(i));
  }
  size_t count = 0;
  for (const std::vector<int>& o : owned) count = std::max(count, o.size());
  std::vector<MuonRound> rounds(count);
  for (size_t r = 0; r < count; ++r) {
    MuonRound& round = rounds[r];
    round.matrix.assign(size_t(ranks), -1);
    for (int o = 0; o < ranks; ++o) {
      if (r >= owned[size_t(o)].size()) continue;
      const int i = owned[size_t(o)][r];
      round.matrix[size_t(o)] = i;
      const MuonSpan& m = mats[size_t(i)];
      if (shard == 0) {  // every rank holds the matrix: the owner has it, every rank gets it
        for (int p = 0; p < ranks; ++p) round.scatter.push_back({o, p, m.offset, m.numel});
        continue;
      }
      const int first = int(m.offset / shard), last = int((m.offset + m.numel - 1) / shard);
      ZS_CHECK(last < ranks);
      for (int p = first; p <= last; ++p) {
        const int64_t lo = std::max(m.offset, p * shard);
        const int64_t hi = std::min(m.offset + m.numel, (p + 1) * shard);
        round.gather.push_back({p, o, lo, hi - lo});
        round.scatter.push_back({o, p, lo, hi - lo});
      }
    }
  }
  return rounds;
}

}  // namespace zeroshard
