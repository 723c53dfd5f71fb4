// `zeroshard ckpt`: inspect prints a checkpoint's manifest as a table; verify checks every
// checksum of every file, with a progress line on stderr. Both exit non-zero with the reason
// when the checkpoint is damaged.
#include "apps/ckpt/ckpt.hpp"

#include <unistd.h>

#include <chrono>
#include <cstdio>

#include "zeroshard/checkpoint.hpp"
#include "zeroshard/error.hpp"

namespace zsckpt {

namespace {

void usage(std::FILE* out) {
  std::fprintf(out,
               "usage: zeroshard ckpt inspect PATH   print the manifest (tag, step, groups, "
               "units)\n"
               "       zeroshard ckpt verify PATH    check every block's checksum\n"
               "PATH is a tag directory, or a checkpoint root (its latest tag is read).\n");
}

int verify(const std::string& path) {
  const bool tty = ::isatty(2);
  auto last = std::chrono::steady_clock::now();
  auto progress = [&](int64_t done, int64_t total) {
    const auto now = std::chrono::steady_clock::now();
    if (done < total && now - last < std::chrono::milliseconds(200)) return;
    last = now;
    std::fprintf(stderr, "%sverified %.1f of %.1f MiB%s", tty ? "\r" : "", double(done) / 1048576,
                 double(total) / 1048576, tty ? "" : "\n");
  };
  int64_t bytes = 0;
  try {
    bytes = zeroshard::verify_checkpoint(path, progress);
  } catch (...) {
    if (tty) std::fprintf(stderr, "\n");  // end the progress line
    throw;
  }
  if (tty) std::fprintf(stderr, "\n");
  std::printf("%s: intact (%lld bytes of data verified)\n", path.c_str(),
              static_cast<long long>(bytes));
  return 0;
}

}  // namespace

int run_ckpt(const std::vector<std::string>& args) {
  if (args.size() == 1 && (args[0] == "--help" || args[0] == "-h")) {
    usage(stdout);
    return 0;
  }
  if (args.size() != 2 || (args[0] != "inspect" && args[0] != "verify")) {
    usage(stderr);
    return 2;
  }
  try {
    if (args[0] == "inspect") {
      std::fputs(zeroshard::describe_checkpoint(args[1]).c_str(), stdout);
      return 0;
    }
    return verify(args[1]);
  } catch (const zeroshard::Error& e) {
    std::fprintf(stderr, "zeroshard ckpt %s: %s\n", args[0].c_str(), e.what());
    return 1;
  }
}

}  // namespace zsckpt
