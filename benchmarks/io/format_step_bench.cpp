// The NVMe-offloaded optimizer step with each optimizer-state format: f32, bf16 and 8-bit
// moments in the swap records, each optionally with a bf16 master ("8bit/bf16"). One engine per
// format (same model, same gradients, each with its own swap file in DIR), stepped in turn in every
// round, the order rotating round by round so drift hits all alike (docs/DESIGN.md rule 9). Per
// round and format: the seconds Engine::step() takes and the bytes it reads and writes
// (swap_stats()); the figure is the median over rounds of f32's step time / the format's, measured
// in the same round.
//
//   format_step_bench --dir DIR [--params 256M] [--units 16] [--rounds 5] [--bs 1M] [--qd 8]
//                     [--buffers 4] [--stage 1] [--block 2048] [--formats f32,bf16,8bit,8bit/bf16]
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "benchmarks/io/step_model.hpp"
#include "zeroshard/zeroshard.hpp"

using namespace zeroshard;
using zeroshard::bench::now;

namespace {

// The moments' format, and the master's after a '/' (f32 when absent).
struct Format {
  std::string name;
  StateFormat moments = StateFormat::f32;
  bool bf16_master = false;
};

struct Options : bench::StepOptions {
  Options() { params = 256000000; }
  int block = 2048;
  std::vector<Format> formats = {{"f32"}, {"bf16", StateFormat::bf16}, {"8bit", StateFormat::q8}};
};

[[noreturn]] void usage(const std::string& why) {
  std::fprintf(stderr,
               "%s\nusage: format_step_bench --dir DIR [--params 256M] [--units 16] [--rounds 5] "
               "[--bs 1M] [--qd 8] [--buffers 4] [--stage 1] [--block 2048] "
               "[--formats f32,bf16,8bit,8bit/bf16]\n",
               why.c_str());
  std::exit(2);
}

Format format_of(const std::string& s) {
  const size_t slash = s.find('/');
  const std::string moments = s.substr(0, slash);
  const std::string master = slash == std::string::npos ? "f32" : s.substr(slash + 1);
  if (master != "f32" && master != "bf16") usage("unknown master " + master + " (f32 or bf16)");
  for (StateFormat f : {StateFormat::f32, StateFormat::bf16, StateFormat::q8})
    if (moments == state_format_name(f)) return {s, f, master == "bf16"};
  usage("unknown format " + moments + " (f32, bf16 or 8bit)");
}

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; i += 2) {
    const std::string k = argv[i];
    if (i + 1 >= argc) usage("missing value after " + k);
    const std::string v = argv[i + 1];
    if (bench::take_step_option(o, k, v)) continue;
    if (k == "--block")
      o.block = std::atoi(v.c_str());
    else if (k == "--formats") {
      o.formats.clear();
      std::stringstream ss(v);
      for (std::string f; std::getline(ss, f, ',');) o.formats.push_back(format_of(f));
    } else {
      usage("unknown option " + k);
    }
  }
  if (o.dir.empty()) usage("--dir is required");
  if (o.params <= 0 || o.units <= 0 || o.rounds <= 0) usage("sizes and counts must be positive");
  if (o.formats.empty() || o.formats[0].name != "f32")
    usage("--formats must start with f32 (the reference)");
  return o;
}

Config make_config(const Options& o, const Format& f) {
  Config c;
  c.stage = o.stage;
  c.dtype = DType::bf16;
  c.optimizer.kind = OptimizerKind::adamw;
  c.optimizer_state = f.moments;
  c.bf16_master = f.bf16_master;
  c.state_block = o.block;
  c.offload_optimizer.tier = Tier::nvme;
  c.offload_optimizer.nvme_paths = {o.dir};
  c.offload_optimizer.buffer_count = o.buffers;
  c.aio.block_size = o.bs;
  c.aio.queue_depth = o.qd;
  return c;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

struct Measured {
  std::vector<double> step_s, speedup;  // per round; speedup = f32's step_s / this one's
  double read = 0, written = 0;         // bytes of the last round
};

}  // namespace

int main(int argc, char** argv) {
  const Options o = parse(argc, argv);
  try {
    auto comm = make_self_communicator();
    std::vector<std::unique_ptr<Engine>> engines;
    for (const Format& f : o.formats) {
      engines.push_back(std::make_unique<Engine>(make_config(o, f), comm));
      bench::build_units(*engines.back(), o.params, o.units);
    }
    const size_t nf = engines.size();
    std::printf(
        "format_step_bench: %lld parameters in %d units, bf16, AdamW, stage %d, nvme block %lld, "
        "depth %d, %d buffers, q8 block %d\n",
        (long long)o.params, o.units, o.stage, (long long)o.bs, o.qd, o.buffers, o.block);
    for (size_t k = 0; k < nf; ++k) {  // warm-up: first steps touch fresh memory and blocks
      bench::synthetic_backward(*engines[k], 0);
      engines[k]->step();
    }
    std::printf("%-6s %-10s %9s %9s %9s %9s\n", "round", "format", "read_GB", "write_GB", "step_s",
                "f32/this");
    std::vector<Measured> m(nf);
    for (int r = 1; r <= o.rounds; ++r) {
      std::vector<double> t(nf);
      for (size_t j = 0; j < nf; ++j) {
        const size_t k = (j + size_t(r)) % nf;
        Engine& e = *engines[k];
        bench::synthetic_backward(e, r);
        const SwapStats s0 = e.swap_stats();
        const double t0 = now();
        e.step();
        t[k] = now() - t0;
        const SwapStats s1 = e.swap_stats();
        m[k].read = double(s1.bytes_read - s0.bytes_read);
        m[k].written = double(s1.bytes_written - s0.bytes_written);
      }
      for (size_t k = 0; k < nf; ++k) {
        m[k].step_s.push_back(t[k]);
        m[k].speedup.push_back(t[0] / t[k]);
        std::printf("%-6d %-10s %9.3f %9.3f %9.3f %9.3f\n", r, o.formats[k].name.c_str(),
                    m[k].read / 1e9, m[k].written / 1e9, t[k], t[0] / t[k]);
      }
      std::fflush(stdout);
    }
    std::printf("\n%-10s %12s %12s %12s %14s %18s\n", "format", "read B/param", "write B/param",
                "median step_s", "bytes f32/this", "speedup (min-max)");
    for (size_t k = 0; k < nf; ++k) {
      const double p = double(o.params);
      const auto [lo, hi] = std::minmax_element(m[k].speedup.begin(), m[k].speedup.end());
      std::printf("%-10s %12.2f %12.2f %12.3f %14.2f %9.3f (%.2f-%.2f)\n",
                  o.formats[k].name.c_str(), m[k].read / p, m[k].written / p, median(m[k].step_s),
                  (m[0].read + m[0].written) / (m[k].read + m[k].written), median(m[k].speedup),
                  *lo, *hi);
    }
  } catch (const Error& e) {
    std::fprintf(stderr, "format_step_bench: %s\n", e.what());
    return 1;
  }
  return 0;
}
