// The swapper's sequential write and read bandwidth, through exactly the engine's path: swap
// files in a per-run directory, O_DIRECT, registered buffers and files, the I/O thread keeping
// queue_depth requests of block_size bytes in flight, every block checksummed on write and
// verified on read. fio_vs_swapper.sh runs it back to back with fio on the same settings.
//
//   swap_bench --dir /nvme/a[,/nvme/b] --size 4G --bs 1M --qd 8 --mode write|read|both
//
// Prints one line per direction: "swapper <write|read> <bytes> <seconds> <MB/s>", measured on a
// file already written once (untimed), as swap files are in steady state.
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "benchmarks/io/parse_size.hpp"
#include "offload/io_queue.hpp"
#include "offload/pinned_pool.hpp"
#include "offload/run_dir.hpp"
#include "offload/swap_store.hpp"
#include "zeroshard/error.hpp"

using namespace zeroshard;
using namespace zeroshard::offload;

namespace {

// Sizes here are bytes: "1M" is 2^20.
int64_t parse_size(const std::string& s) {
  return bench::parse_size(s, true);
}

double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<std::string> dirs;
  int64_t size = int64_t(1) << 30, bs = 1 << 20, chunk = 64 << 20;
  int qd = 8;
  std::string mode = "both";
  bool checksums = true;
  int slots = 2;  // chunks in flight
  for (int i = 1; i + 1 < argc; i += 2) {
    std::string k = argv[i], v = argv[i + 1];
    if (k == "--dir") {
      for (size_t a = 0, b; a <= v.size(); a = b + 1) {
        b = v.find(',', a);
        if (b == std::string::npos) b = v.size();
        dirs.push_back(v.substr(a, b - a));
      }
    } else if (k == "--size")
      size = parse_size(v);
    else if (k == "--bs")
      bs = parse_size(v);
    else if (k == "--qd")
      qd = std::atoi(v.c_str());
    else if (k == "--chunk")
      chunk = parse_size(v);
    else if (k == "--mode")
      mode = v;
    else if (k == "--checksums")  // diagnostic only: what hashing costs
      checksums = v != "0";
    else if (k == "--slots")
      slots = std::max(1, std::atoi(v.c_str()));
    else {
      std::fprintf(stderr, "unknown option %s\n", k.c_str());
      return 2;
    }
  }
  if (dirs.empty()) {
    std::fprintf(
        stderr,
        "usage: swap_bench --dir DIR[,DIR...] [--size 1G] [--bs 1M] [--qd 8] [--mode both]\n");
    return 2;
  }
  try {
    // The file is cut into extents of `chunk` bytes, staged through two pinned buffers: while one
    // extent's requests drain, the next is already queued, so the queue never runs dry.
    chunk = std::min(chunk, size);
    const int n = int((size + chunk - 1) / chunk);
    Ledger ledger;
    std::vector<RunDir> run;
    run.reserve(dirs.size());
    std::vector<const RunDir*> ptrs;
    for (const auto& d : dirs) {
      run.emplace_back(d, 0);
      ptrs.push_back(&run.back());
    }
    SwapStore store("bench", "bench.swap", ptrs, bs);
    std::vector<int> ext;
    for (int i = 0; i < n; ++i)
      ext.push_back(store.add_extent(uint64_t(std::min(chunk, size - int64_t(i) * chunk))));
    store.open(true);
    PinnedPool pool(&ledger, "bench_staging", slots, size_t(chunk), true);
    for (int s = 0; s < slots; ++s)
      for (int64_t j = 0; j < chunk; ++j) pool.data(s)[j] = char(j * 2654435761u >> 13);
    BackendSetup setup;
    setup.fds = store.fds();
    pool.append_iovecs(setup.buffers);
    setup.queue_depth = qd;
    IoQueue io(make_uring_backend(setup), store.file_names());

    auto pass = [&](bool write, bool print) {
      std::vector<std::shared_ptr<IoBatch>> inflight(static_cast<size_t>(slots));
      const double t0 = now();
      for (int i = 0; i < n; ++i) {
        const int s = i % slots;
        if (inflight[s]) io.wait(*inflight[s]);
        std::vector<Piece> ps;
        store.pieces(ext[size_t(i)], pool.data(s), &pool, write, ps);
        if (!checksums)
          for (Piece& p : ps) p.checksum = nullptr;
        inflight[s] = io.submit(std::move(ps), write ? "bench write" : "bench read");
      }
      for (auto& b : inflight)
        if (b) io.wait(*b);
      const double dt = now() - t0;
      if (print)
        std::printf("swapper %s %lld %.4f %.1f\n", write ? "write" : "read", (long long)size, dt,
                    double(size) / dt / 1e6);
      std::fflush(stdout);
    };
    // The file is written once untimed: swap files are overwritten every step, so the steady
    // state is an overwrite (a fresh fallocate()d file also pays ext4's unwritten-extent
    // conversion on its first write). A read pass then reads what was written and verifies it.
    pass(true, false);
    if (mode == "write" || mode == "both") pass(true, true);
    if (mode == "read" || mode == "both") pass(false, true);
  } catch (const Error& e) {
    std::fprintf(stderr, "swap_bench: %s\n", e.what());
    return 1;
  }
  return 0;
}
