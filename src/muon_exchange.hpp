#pragma once
// Muon's matrices, their owners and the exchange of one unit, as rounds of point-to-point
// pieces: src/engine_muon.cpp runs it, src/planner/ plans and times it, from this one code. In
// each round every rank orthogonalises at most one matrix: the holders of its pieces send them
// to it, and it sends the result back to them. So a rank holds at most one matrix whole at a
// time, and each element crosses between ranks at most twice, only where its holder is not its
// matrix's owner.

#include <cstdint>
#include <vector>

#include "base/layout.hpp"
#include "zeroshard/config.hpp"

namespace zeroshard {

/// One Muon matrix of a unit (a parameter `rows` × `cols`, its first dimension by the rest):
/// where it lies in the unit's flat buffer, the rank of the shard group that orthogonalises it,
/// and the iteration's multiply-adds (cpu::newton_schulz_cost()).
struct MuonMatrix {
  int param = 0;  // in the unit's layout
  int64_t offset = 0, rows = 0, cols = 0;
  int owner = 0;
  double cost = 0;
  int64_t numel() const { return rows * cols; }
};

/// The Muon matrices of unit `L` (its parameters of two or more dimensions in a Muon group of
/// `groups`, indexed by group id; empty ones left out), in offset order, each given an owner
/// among `load.size()` ranks by cpu::assign_owners() in the layout's order, with `load` carried
/// from unit to unit. Throws Error(invalid_argument) on a parameter of a group `groups` lacks.
std::vector<MuonMatrix> muon_matrices(const UnitLayout& L,
                                      const std::vector<OptimizerOptions>& groups,
                                      std::vector<double>& load);

/// A piece moved between two ranks, in the unit's coordinates (from == to: a copy).
struct MuonTransfer {
  int from = 0, to = 0;
  int64_t offset = 0, count = 0;
};

/// One round of a unit's exchange.
struct MuonRound {
  std::vector<int> matrix;           // per rank: the index of the matrix it orthogonalises, or −1
  std::vector<MuonTransfer> gather;  // each piece of those matrices, holder to owner
  std::vector<MuonTransfer> scatter;  // the results, owner to every holder of a piece
};

/// The rounds of a unit whose Muon matrices are `mats` (in offset order, none empty) over
/// `ranks` ranks. Rank p holds [p·shard, (p+1)·shard) of the unit; with `shard` 0 every rank
/// holds it whole, so nothing is gathered (the owner has the matrix) and every rank receives
/// every result. A rank's matrices go in offset order, its r-th in round r.
std::vector<MuonRound> muon_rounds(const std::vector<MuonMatrix>& mats, int ranks, int64_t shard);

}  // namespace zeroshard
