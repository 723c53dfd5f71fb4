#pragma once
// `zeroshard capacity`: the Python tool zeroshard.capacity (it draws its plots with matplotlib),
// run by an interpreter that imports the zeroshard package.

#include <string>
#include <vector>

namespace zscli {

/// The interpreters tried, in order: $ZEROSHARD_PYTHON (only it, when set), $VIRTUAL_ENV's
/// python, the .venv of the checkout this executable was built in (scripts/python_test.sh
/// installs the package there), python3 on PATH, /usr/bin/python3.
std::vector<std::string> python_candidates(const std::string& exe_path);

/// Runs `PYTHON -m zeroshard.capacity ARGS` with the first candidate that imports it (never
/// returns then); else prints every interpreter tried and how to fix it, and returns 127.
int run_capacity(const std::vector<std::string>& args);

}  // namespace zscli
