#pragma once
// `zeroshard plan`: the memory every stage and offload choice would take per rank for a model, from
// the engine's own setup (zeroshard::plan_memory), against the memory a machine has.

#include <string>
#include <vector>

namespace zsplan {

/// Runs the command with the arguments after "plan"; returns the exit code (0, or 2 on bad
/// usage with the reason on stderr).
int run_plan(const std::vector<std::string>& args);

}  // namespace zsplan
