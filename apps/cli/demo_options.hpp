#pragma once
// `zeroshard demo` flags: parsing, validation, the help text, and the resolution of the engine
// configuration (demo defaults, or a JSON file in the library's / DeepSpeed's format, then the
// flags on top).

#include <cstdint>
#include <string>
#include <vector>

#include "zeroshard/config.hpp"

namespace zsdemo {

struct DemoOptions {
  // Model and data.
  int64_t layers = 4, dim = 256, heads = 4, seq = 64;
  int64_t batch = 8;      ///< sequences per rank per micro-step
  std::string text_path;  ///< empty: the generated corpus
  int64_t corpus_chars = 2000000;
  uint64_t seed = 1234;
  // Schedule.
  int64_t steps = 100;
  int64_t warmup = -1;  ///< −1: steps / 10
  // Checkpoints.
  std::string save_root;   ///< empty: no checkpoint
  int64_t save_every = 0;  ///< 0: only after the last step
  std::string resume;      ///< a tag directory, or a root (its latest tag); empty: from scratch
  // Output.
  int log_every = 0;  ///< 0: about 30 progress lines per run
  bool quiet = false;
  bool dp_reference = true;  ///< measure a stage-0 engine on the same model for the memory table
  std::string report_json;
  int64_t sample_chars = 160;
  int blas_threads = 0;  ///< 0: cores / ranks on this machine
  /// The resolved engine configuration; its optimizer.lr is the peak of the schedule.
  zeroshard::Config config;
  std::string config_path;  ///< for the summary; empty if no --config
};

enum class ParseResult { run, help, error };

/// Parses `args` (after "demo"). On error fills `error` with a one-line reason.
ParseResult parse_demo_options(const std::vector<std::string>& args, DemoOptions& out,
                               std::string& error);

/// The `zeroshard demo --help` text: every flag with its default.
std::string demo_help();

}  // namespace zsdemo
