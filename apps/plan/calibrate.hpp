#pragma once
// `zeroshard calibrate`: measures what the planner's step-time model needs on the machine it
// runs on, over the MPI ranks it is launched with, and writes it as a calibration file (JSON).

#include <string>
#include <vector>

namespace zsplan {

/// Runs the command with the arguments after "calibrate"; returns the exit code (0; 1 when a
/// measurement failed; 2 on bad usage, with the reason on stderr).
int run_calibrate(const std::vector<std::string>& args);

}  // namespace zsplan
