#pragma once
// The start every `zeroshard <command>` shares: --help anywhere prints the command's help, and
// bad flags (its parser throws std::invalid_argument) end it with the reason and exit code 2.

#include <algorithm>
#include <cstdio>
#include <stdexcept>
#include <string>
#include <vector>

namespace zscli {

/// Fills `out` from `args` with `parse`; returns -1 to go on, else the exit code to return.
template <class Options, class Parse>
int start_subcommand(const char* name, const char* help, const std::vector<std::string>& args,
                     Parse parse, Options& out) {
  if (std::find(args.begin(), args.end(), "--help") != args.end()) {
    std::fputs(help, stdout);
    return 0;
  }
  try {
    out = parse(args);
  } catch (const std::invalid_argument& e) {
    std::fprintf(stderr, "zeroshard %s: %s\n", name, e.what());
    return 2;
  }
  return -1;
}

}  // namespace zscli
