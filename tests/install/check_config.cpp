// Parses a JSON configuration file (the example of docs/configuration.md) with the installed
// zeroshard and prints what it understood. Exits non-zero if the file does not parse or validate.
#include <cstdio>
#include <zeroshard/zeroshard.hpp>

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s CONFIG.json\n", argv[0]);
    return 2;
  }
  try {
    const zeroshard::Config c = zeroshard::Config::from_json_file(argv[1]);
    c.validate();
    std::printf("stage %d, dtype %s, optimizer %s (lr %g), optimizer state on %s, clipping %g\n",
                c.stage, zeroshard::dtype_name(c.dtype),
                zeroshard::optimizer_name(c.optimizer.kind), c.optimizer.lr,
                zeroshard::tier_name(c.offload_optimizer.tier), c.gradient_clipping);
    return 0;
  } catch (const zeroshard::Error& e) {
    std::fprintf(stderr, "%s: %s\n", argv[1], e.what());
    return 1;
  }
}
