// An NVMe-offloaded optimizer step against its floor: the larger of
//   bytes the step reads / the swapper's read bandwidth,
//   bytes the step writes / the swapper's write bandwidth,
//   the compute time of the same update in memory (the host tier, same model and gradients).
// A step at the floor overlaps reading, updating and writing completely. Each round measures
// all four in turn in one process (docs/DESIGN.md rule 9); the median of the per-round ratios
// step / floor is the figure. A second ratio divides by the "shared-drive floor": the time the
// swapper takes to read the step's bytes while writing its written bytes concurrently, which is
// the bound on a drive whose reads and writes share one bandwidth (then r/R + w/W, not max).
//
//   step_floor_bench --dir DIR --params 128M --units 16 [--rounds 5] [--bs 1M] [--qd 8]
//                    [--buffers 4] [--stage 1|2|3] [--dtype bf16|f32]
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "benchmarks/io/step_model.hpp"
#include "offload/io_queue.hpp"
#include "offload/pinned_pool.hpp"
#include "offload/run_dir.hpp"
#include "offload/swap_store.hpp"
#include "zeroshard/zeroshard.hpp"

using namespace zeroshard;

namespace {

using zeroshard::bench::now;

// The swapper's sequential write and read bandwidth (bytes/s) through the engine's path (pinned
// staging, O_DIRECT, checksums, same block size and depth), and the seconds it takes to read
// `rd` bytes while writing `wr` bytes at the same time: on a drive whose reads and writes share
// one bandwidth, that (not the larger of the two one-way times) is what a step can approach.
struct Bandwidth {
  double write = 0, read = 0, mixed_s = 0;
};
Bandwidth swapper_bandwidth(const std::string& dir, int64_t rd, int64_t wr, int64_t bs, int qd) {
  using namespace zeroshard::offload;
  const int64_t chunk = int64_t(64) << 20;
  Ledger ledger;
  RunDir run(dir, 0);
  SwapStore store("bandwidth", "bandwidth.swap", {&run}, bs);
  auto extents = [&](int64_t bytes) {
    std::vector<int> ext;
    for (int64_t o = 0; o < bytes; o += chunk)
      ext.push_back(store.add_extent(uint64_t(std::min(chunk, bytes - o))));
    return ext;
  };
  const std::vector<int> a = extents(std::max(rd, wr)), b = extents(wr);
  store.open(true);
  PinnedPool pool(&ledger, "bandwidth", 4, size_t(chunk), true);
  BackendSetup setup;
  setup.fds = store.fds();
  pool.append_iovecs(setup.buffers);
  setup.queue_depth = qd;
  IoQueue io(make_uring_backend(setup), store.file_names());
  // Streams extents through two pool slots starting at `slot0`, two batches in flight.
  struct Stream {
    const std::vector<int>* ext;
    bool write;
    int slot0;
    size_t next = 0;
    std::shared_ptr<IoBatch> inflight[2];
  };
  auto step = [&](Stream& st) {  // queues the next extent; false when all are queued
    if (st.next >= st.ext->size()) return false;
    auto& slot = st.inflight[st.next % 2];
    if (slot) io.wait(*slot);
    std::vector<Piece> ps;
    store.pieces((*st.ext)[st.next], pool.data(st.slot0 + int(st.next % 2)), &pool, st.write, ps);
    slot = io.submit(std::move(ps), "bandwidth");
    ++st.next;
    return true;
  };
  auto drain = [&](Stream& st) {
    for (auto& x : st.inflight)
      if (x) io.wait(*x);
  };
  auto timed = [&](std::vector<Stream> streams) {
    const double t0 = now();
    for (bool more = true; more;) {
      more = false;
      for (Stream& st : streams) more = step(st) || more;
    }
    for (Stream& st : streams) drain(st);
    return now() - t0;
  };
  Bandwidth out;
  std::vector<int> a_rd(a.begin(), a.begin() + long((rd + chunk - 1) / chunk));
  timed({{&b, true, 2}});  // first writes pay for fresh extents: untimed, as in steady state
  out.write = double(std::max(rd, wr)) / timed({{&a, true, 0}});
  out.read = double(rd) / timed({{&a_rd, false, 0}});
  out.mixed_s = timed({{&a_rd, false, 0}, {&b, true, 2}});
  return out;
}

struct Options : bench::StepOptions {
  DType dtype = DType::bf16;
};

Config make_config(const Options& o, Tier tier) {
  Config c;
  c.stage = o.stage;
  c.dtype = o.dtype;
  c.optimizer.kind = OptimizerKind::adamw;
  c.offload_optimizer.tier = tier;
  if (tier == Tier::nvme) c.offload_optimizer.nvme_paths = {o.dir};
  c.offload_optimizer.buffer_count = o.buffers;
  c.aio.block_size = o.bs;
  c.aio.queue_depth = o.qd;
  return c;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  for (int i = 1; i + 1 < argc; i += 2) {
    std::string k = argv[i], v = argv[i + 1];
    if (bench::take_step_option(o, k, v)) continue;
    if (k == "--dtype")
      o.dtype = v == "f32" ? DType::f32 : DType::bf16;
    else {
      std::fprintf(stderr, "unknown option %s\n", k.c_str());
      return 2;
    }
  }
  if (o.dir.empty()) {
    std::fprintf(
        stderr,
        "usage: step_floor_bench --dir DIR [--params 128M] [--units 16] [--rounds 5] ...\n");
    return 2;
  }
  try {
    auto comm = make_self_communicator();
    Engine mem(make_config(o, Tier::host), comm), nvme(make_config(o, Tier::nvme), comm);
    bench::build_units(mem, o.params, o.units);
    bench::build_units(nvme, o.params, o.units);
    std::printf(
        "step_floor_bench: %lld parameters in %d units, %s, stage %d, block %lld, depth %d, %d "
        "buffers (read-ahead %d)\n",
        (long long)o.params, o.units, dtype_name(o.dtype), o.stage, (long long)o.bs, o.qd,
        o.buffers, std::max(1, o.buffers - 2));
    // Warm-up: first steps touch fresh memory and fresh file blocks.
    bench::synthetic_backward(mem, 0);
    mem.step();
    bench::synthetic_backward(nvme, 0);
    nvme.step();
    std::printf("%-6s %9s %9s %9s %9s %9s %9s %9s %9s %9s %7s %7s\n", "round", "read_GB",
                "write_GB", "rd_GB/s", "wr_GB/s", "mem_s", "floor_s", "mixed_s", "nvme_s", "wait_s",
                "ratio", "shared");
    std::vector<double> ratios, shared;
    for (int r = 1; r <= o.rounds; ++r) {
      bench::synthetic_backward(mem, r);
      const double mem_s = mem.step().optimizer_s;
      bench::synthetic_backward(nvme, r);
      const SwapStats s0 = nvme.swap_stats();
      const double t0 = now();
      nvme.step();
      const double nvme_s = now() - t0;
      const SwapStats s1 = nvme.swap_stats();
      const double rd = double(s1.bytes_read - s0.bytes_read),
                   wr = double(s1.bytes_written - s0.bytes_written);
      const Bandwidth bw = swapper_bandwidth(o.dir, int64_t(rd), int64_t(wr), o.bs, o.qd);
      const double floor_s = std::max({rd / bw.read, wr / bw.write, mem_s});
      const double shared_s = std::max(bw.mixed_s, mem_s);
      ratios.push_back(nvme_s / floor_s);
      shared.push_back(nvme_s / shared_s);
      std::printf("%-6d %9.3f %9.3f %9.3f %9.3f %9.3f %9.3f %9.3f %9.3f %9.3f %7.3f %7.3f\n", r,
                  rd / 1e9, wr / 1e9, bw.read / 1e9, bw.write / 1e9, mem_s, floor_s, bw.mixed_s,
                  nvme_s, s1.wait_s - s0.wait_s, nvme_s / floor_s, nvme_s / shared_s);
      std::fflush(stdout);
    }
    std::sort(ratios.begin(), ratios.end());
    std::sort(shared.begin(), shared.end());
    std::printf("median step / floor: %.3f   median step / shared-drive floor: %.3f\n",
                ratios[ratios.size() / 2], shared[shared.size() / 2]);
  } catch (const Error& e) {
    std::fprintf(stderr, "step_floor_bench: %s\n", e.what());
    return 1;
  }
  return 0;
}
