#pragma once
// What the demo prints and writes: the run header, one progress line per logged step, the
// ledger table (bytes per rank by tier × kind next to plain data parallel), the step-time
// breakdown, and the machine-readable JSON summary.

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "apps/cli/demo_options.hpp"
#include "apps/model/gpt.hpp"
#include "apps/train/trainer.hpp"
#include "zeroshard/zeroshard.hpp"

namespace zsdemo {

using MemCells = std::array<std::array<int64_t, zeroshard::kNumMemKinds>, zeroshard::kNumTiers>;

/// Sums of one rank's step-time breakdown over the measured steps.
struct RankTimes {
  double interval = 0, optimizer = 0, exposed = 0, busy = 0, compute = 0;
  double comm_bytes = 0, inter_node_bytes = 0;  ///< StepResult's, summed
  int64_t steps = 0;         ///< steps summed (the first, which also pays for set-up, is left out)
  double newton_schulz = 0;  ///< Muon: the part of `optimizer` in the Newton-Schulz iteration
};

struct UnitRow {
  std::string name;
  int64_t numel = 0, padded_numel = 0, shard_numel = 0;
};

struct RunSummary {
  const DemoOptions* options = nullptr;
  GptShape shape;
  int world = 1;
  int64_t params = 0;
  std::vector<UnitRow> units;
  std::string data_source;  ///< "generated corpus" or the text file's path
  int64_t tokens_per_step = 0;
  std::vector<StepLog> steps;  ///< losses are the means over ranks
  double val_before = 0, val_after = 0;
  double train_wall_s = 0;
  std::string sample;
  std::vector<MemCells> rank_bytes, rank_peak;  ///< per rank, from each rank's ledger
  zeroshard::MemoryReport rank0;                ///< rank 0's ledger with its named buffers
  MemCells dp_bytes{};                          ///< a stage-0 engine's ledger for the same model
  zeroshard::MemoryReport dp0;
  std::vector<RankTimes> times;  ///< per rank
};

void print_header(const RunSummary& s);
/// One progress line for `log` (loss = mean over ranks), with tokens/s measured over `window_s`
/// seconds covering `window_steps` steps.
void print_progress(const RunSummary& s, const StepLog& log, double window_s, int64_t window_steps,
                    double elapsed_s);
void print_final(const RunSummary& s);
/// Writes the JSON summary; throws std::runtime_error if the file cannot be written.
void write_json(const RunSummary& s, const std::string& path);

}  // namespace zsdemo
