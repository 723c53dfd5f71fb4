#pragma once
// `zeroshard demo`: trains the demo GPT on the engine and reports memory and time.

#include <string>
#include <vector>

namespace zsdemo {

/// Runs the subcommand with the arguments after "demo"; returns the process exit code
/// (0 success, 1 a failure while running, 2 bad flags).
int run_demo(const std::vector<std::string>& args);

}  // namespace zsdemo
