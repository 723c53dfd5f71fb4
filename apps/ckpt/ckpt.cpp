// `zeroshard ckpt`: inspect prints a checkpoint's manifest as a table; verify checks every
// checksum of every file; export writes safetensors files of the weights and the optimizer
// state. Progress goes to stderr; each exits non-zero with the reason when the checkpoint is
// damaged.
#include "apps/ckpt/ckpt.hpp"

#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <exception>
#include <functional>

#include "zeroshard/checkpoint.hpp"

namespace zsckpt {

namespace {

void usage(std::FILE* out) {
  std::fprintf(
      out,
      "usage: zeroshard ckpt inspect PATH   print the manifest (tag, step, groups, "
      "units)\n"
      "       zeroshard ckpt verify PATH    check every block's checksum\n"
      "       zeroshard ckpt export PATH OUT_DIR [--max-shard-size BYTES]\n"
      "                                     write OUT_DIR/model.safetensors (f32 weights under\n"
      "                                     every name, the module's frozen tensors and buffers)\n"
      "                                     and OUT_DIR/optimizer.safetensors; a model above\n"
      "                                     BYTES (default 5000000000, as Hugging Face; suffixes\n"
      "                                     KB MB GB, KiB MiB GiB; 0: never) is split into\n"
      "                                     model-0000i-of-0000n.safetensors and\n"
      "                                     model.safetensors.index.json\n"
      "PATH is a tag directory, or a checkpoint root (its latest tag is read).\n");
}

// A progress line on stderr ("verified 12.0 of 68.7 MiB"), redrawn at most 5 times a second
// on a terminal, a line per update elsewhere; ended before anything else is printed.
class Progress {
 public:
  explicit Progress(const char* verb) : verb_(verb), tty_(::isatty(2)) {}
  ~Progress() {
    if (tty_ && shown_) std::fprintf(stderr, "\n");
  }
  void operator()(int64_t done, int64_t total) {
    const auto now = std::chrono::steady_clock::now();
    if (done < total && now - last_ < std::chrono::milliseconds(200)) return;
    last_ = now;
    shown_ = true;
    std::fprintf(stderr, "%s%s %.1f of %.1f MiB%s", tty_ ? "\r" : "", verb_, double(done) / 1048576,
                 double(total) / 1048576, tty_ ? "" : "\n");
  }

 private:
  const char* verb_;
  bool tty_, shown_ = false;
  std::chrono::steady_clock::time_point last_{};
};

int verify(const std::string& path) {
  int64_t bytes = 0;
  {
    Progress progress("verified");
    bytes = zeroshard::verify_checkpoint(path, std::ref(progress));
  }
  std::printf("%s: intact (%lld bytes of data verified)\n", path.c_str(),
              static_cast<long long>(bytes));
  return 0;
}

// "5GB", "500MiB", "123": bytes; -1 for anything else.
int64_t parse_bytes(const std::string& s) {
  size_t used = 0;
  double v = 0;
  try {
    v = std::stod(s, &used);
  } catch (const std::exception&) {
    return -1;
  }
  const std::string unit = s.substr(used);
  const std::pair<const char*, double> units[] = {{"", 1},          {"B", 1},        {"KB", 1e3},
                                                  {"MB", 1e6},      {"GB", 1e9},     {"KiB", 1024},
                                                  {"MiB", 1 << 20}, {"GiB", 1 << 30}};
  for (auto [name, scale] : units)
    if (unit == name && v >= 0 && v * scale < 9e18) return int64_t(v * scale);
  return -1;
}

int export_to(const std::string& path, const std::string& out, int64_t max_shard_bytes) {
  {
    Progress progress("exported");
    zeroshard::export_checkpoint(path, out, std::ref(progress), max_shard_bytes);
  }
  std::printf("%s: the model's safetensors and optimizer.safetensors written\n", out.c_str());
  return 0;
}

}  // namespace

int run_ckpt(const std::vector<std::string>& args) {
  if (args.size() == 1 && (args[0] == "--help" || args[0] == "-h")) {
    usage(stdout);
    return 0;
  }
  const bool two = args.size() == 2 && (args[0] == "inspect" || args[0] == "verify");
  const bool three = !args.empty() && args[0] == "export" &&
                     (args.size() == 3 || (args.size() == 5 && args[3] == "--max-shard-size"));
  if (!two && !three) {
    usage(stderr);
    return 2;
  }
  try {
    if (args[0] == "inspect") {
      std::fputs(zeroshard::describe_checkpoint(args[1]).c_str(), stdout);
      return 0;
    }
    if (args[0] == "export") {
      const int64_t limit = args.size() == 5 ? parse_bytes(args[4]) : zeroshard::kExportShardBytes;
      if (limit < 0) {
        std::fprintf(stderr, "zeroshard ckpt export: --max-shard-size %s is no size in bytes\n",
                     args[4].c_str());
        return 2;
      }
      return export_to(args[1], args[2], limit);
    }
    return verify(args[1]);
  } catch (const std::exception& e) {  // zeroshard::Error, and the file system's own errors
    std::fprintf(stderr, "zeroshard ckpt %s: %s\n", args[0].c_str(), e.what());
    return 1;
  }
}

}  // namespace zsckpt
