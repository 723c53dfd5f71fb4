// Muon's exchange as rounds of point-to-point pieces (the contract is in muon_exchange.hpp).
#include "src/muon_exchange.hpp"

#include <algorithm>

#include "base/check.hpp"
#include "kernels/cpu/newton_schulz.hpp"

namespace zeroshard {

std::vector<MuonMatrix> muon_matrices(const UnitLayout& L,
                                      const std::vector<OptimizerOptions>& groups,
                                      std::vector<double>& load) {
  std::vector<MuonMatrix> out;
  std::vector<double> cost;
  for (size_t j = 0; j < L.params.size(); ++j) {
    const ParamSlot& p = L.params[j];
    if (p.group < 0 || size_t(p.group) >= groups.size())
      ZS_THROW(invalid_argument, "parameter '" << p.name << "' of unit '" << L.name
                                               << "' is in group " << p.group << " of "
                                               << groups.size());
    const OptimizerOptions& g = groups[size_t(p.group)];
    if (g.kind != OptimizerKind::muon || p.shape.size() < 2 || p.numel == 0) continue;
    MuonMatrix m;
    m.param = int(j);
    m.offset = p.offset;
    m.rows = p.shape[0];
    m.cols = p.numel / p.shape[0];
    m.cost = cpu::newton_schulz_cost(m.rows, m.cols, g.ns_steps);
    cost.push_back(m.cost);
    out.push_back(m);
  }
  const std::vector<int> owner = cpu::assign_owners(cost, load);
  for (size_t i = 0; i < out.size(); ++i) out[i].owner = owner[i];
  std::sort(out.begin(), out.end(),
            [](const MuonMatrix& a, const MuonMatrix& b) { return a.offset < b.offset; });
  return out;
}

std::vector<MuonRound> muon_rounds(const std::vector<MuonMatrix>& mats, int ranks, int64_t shard) {
  ZS_CHECK(ranks >= 1 && shard >= 0);
  std::vector<std::vector<int>> owned(static_cast<size_t>(ranks));
  for (size_t i = 0; i < mats.size(); ++i) {
    ZS_CHECK(mats[i].owner >= 0 && mats[i].owner < ranks && mats[i].numel() > 0);
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
      const MuonMatrix& m = mats[size_t(i)];
      if (shard == 0) {  // every rank holds the matrix: the owner has it, every rank gets it
        for (int p = 0; p < ranks; ++p) round.scatter.push_back({o, p, m.offset, m.numel()});
        continue;
      }
      const int first = int(m.offset / shard), last = int((m.offset + m.numel() - 1) / shard);
      ZS_CHECK(last < ranks);
      for (int p = first; p <= last; ++p) {
        const int64_t lo = std::max(m.offset, p * shard);
        const int64_t hi = std::min(m.offset + m.numel(), (p + 1) * shard);
        round.gather.push_back({p, o, lo, hi - lo});
        round.scatter.push_back({o, p, lo, hi - lo});
      }
    }
  }
  return rounds;
}

}  // namespace zeroshard
