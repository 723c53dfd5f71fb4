#pragma once
// `zeroshard ckpt inspect|verify|export`: reads a checkpoint without launching ranks.

#include <string>
#include <vector>

namespace zsckpt {

/// Runs the subcommand with the arguments after "ckpt"; returns the process exit code (0 the
/// checkpoint is intact, 1 it is damaged or unreadable, with the reason on stderr, 2 bad usage).
int run_ckpt(const std::vector<std::string>& args);

}  // namespace zsckpt
