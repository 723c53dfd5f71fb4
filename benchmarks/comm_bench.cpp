// Engine communicator vs raw MPI on the same bytes (docs/DESIGN.md rule 9).
//
// One round = one reduce-scatter followed by one all-gather of a flat buffer of S bytes (each
// rank's shard is S / ranks), the pair a ZeRO step runs per unit. The engine side goes through
// zeroshard's MpiCommunicator (submitted to its communication thread, MPI_Ireduce_scatter_block /
// MPI_Iallgather driven by MPI_Test, Work::wait() on the caller's thread); the raw side calls
// blocking MPI_Reduce_scatter_block + MPI_Allgather from the main thread on the same buffers'
// sizes. Rounds alternate which side goes first; each side's time is the slowest rank's; the
// figure is the median over rounds of engine time / raw time (1.00 = no overhead). A third,
// diagnostic side runs the engine's non-blocking MPI calls directly with MPI_Wait.
//
//   mpirun -np 2 comm_bench [--sizes-kib 256,4096,32768] [--rounds 15]

#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <sstream>
#include <string>
#include <vector>

#include "zeroshard/zeroshard.hpp"

namespace {

struct Options {
  std::vector<int64_t> sizes_kib = {256, 4096, 32768};
  int rounds = 15;
};

[[noreturn]] void usage(const char* why, bool talk) {
  if (talk)
    std::fprintf(
        stderr,
        "comm_bench: %s\nusage: mpirun -np N comm_bench [--sizes-kib K[,K..]] [--rounds R>=7]\n",
        why);
  std::exit(2);
}

Options parse(int argc, char** argv, bool talk) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (i + 1 >= argc) usage(("missing value after " + a).c_str(), talk);
    const std::string v = argv[++i];
    if (a == "--rounds") {
      o.rounds = std::atoi(v.c_str());
    } else if (a == "--sizes-kib") {
      o.sizes_kib.clear();
      std::stringstream ss(v);
      for (std::string t; std::getline(ss, t, ',');) o.sizes_kib.push_back(std::atoll(t.c_str()));
    } else {
      usage(("unknown flag " + a).c_str(), talk);
    }
  }
  if (o.rounds < 7) usage("--rounds must be at least 7 (rule 9)", talk);
  for (int64_t s : o.sizes_kib)
    if (s < 1) usage("sizes must be positive", talk);
  return o;
}

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t k = v.size() / 2;
  return v.size() % 2 ? v[k] : 0.5 * (v[k - 1] + v[k]);
}

}  // namespace

int main(int argc, char** argv) {
  // The library initialises MPI (MPI_THREAD_MULTIPLE) and finalises it at exit; the raw side
  // uses its own duplicate of MPI_COMM_WORLD, so the two never share a communicator.
  std::shared_ptr<zeroshard::Communicator> comm = zeroshard::make_mpi_communicator();
  const int rank = comm->rank(), world = comm->size();
  const Options o = parse(argc, argv, rank == 0);
  MPI_Comm raw;
  MPI_Comm_dup(MPI_COMM_WORLD, &raw);

  if (rank == 0) {
    std::printf("comm_bench: %d ranks, %d rounds, f32, reduce-scatter + all-gather per round\n\n",
                world, o.rounds);
    std::printf(
        "| buffer | ranks | raw MPI ms | engine ms | engine / raw, median (min-max) | raw "
        "non-blocking ms | "
        "non-blocking / raw |\n|---|---|---|---|---|---|---|\n");
  }
  for (int64_t kib : o.sizes_kib) {
    // Whole buffer of `kib` KiB, rounded down to whole shards of f32.
    const int64_t shard = std::max<int64_t>(1, kib * 1024 / 4 / world);
    const size_t n_shard = static_cast<size_t>(shard),
                 n_whole = n_shard * static_cast<size_t>(world);
    std::vector<float> send(n_whole), recv(n_shard), gathered(n_whole);
    for (size_t i = 0; i < send.size(); ++i) send[i] = float((i * 7 + size_t(rank)) % 13) * 0.25f;

    auto slowest = [&](double t) {
      MPI_Allreduce(MPI_IN_PLACE, &t, 1, MPI_DOUBLE, MPI_MAX, raw);
      return t;
    };
    auto engine_round = [&] {
      MPI_Barrier(raw);
      const double t0 = now_s();
      comm->reduce_scatter(send.data(), recv.data(), shard, zeroshard::DType::f32, "bench")->wait();
      comm->all_gather(recv.data(), gathered.data(), shard, zeroshard::DType::f32, "bench")->wait();
      return slowest(now_s() - t0);
    };
    auto raw_round = [&] {
      MPI_Barrier(raw);
      const double t0 = now_s();
      MPI_Reduce_scatter_block(send.data(), recv.data(), int(shard), MPI_FLOAT, MPI_SUM, raw);
      MPI_Allgather(recv.data(), int(shard), MPI_FLOAT, gathered.data(), int(shard), MPI_FLOAT,
                    raw);
      return slowest(now_s() - t0);
    };
    // Diagnostic third side: the non-blocking calls the engine uses (libnbc's algorithms in Open
    // MPI), started and waited for on the main thread with MPI_Wait, which progresses them
    // continuously. Engine vs this isolates the cost of the communication thread's polling;
    // this vs raw isolates the non-blocking algorithms.
    auto nb_round = [&] {
      MPI_Barrier(raw);
      const double t0 = now_s();
      MPI_Request req;
      MPI_Ireduce_scatter_block(send.data(), recv.data(), int(shard), MPI_FLOAT, MPI_SUM, raw,
                                &req);
      MPI_Wait(&req, MPI_STATUS_IGNORE);
      MPI_Iallgather(recv.data(), int(shard), MPI_FLOAT, gathered.data(), int(shard), MPI_FLOAT,
                     raw, &req);
      MPI_Wait(&req, MPI_STATUS_IGNORE);
      return slowest(now_s() - t0);
    };
    engine_round();  // warm-up: connection set-up, first touch of the buffers
    raw_round();
    nb_round();
    std::vector<double> te, tr, tn, ratio, nb_ratio;
    for (int r = 0; r < o.rounds; ++r) {
      // Rotate the order so that drift and cache state favour no side.
      double e = 0, w = 0, b = 0;
      for (int k = 0; k < 3; ++k) {
        switch ((r + k) % 3) {
          case 0:
            e = engine_round();
            break;
          case 1:
            w = raw_round();
            break;
          default:
            b = nb_round();
        }
      }
      te.push_back(e);
      tr.push_back(w);
      tn.push_back(b);
      ratio.push_back(e / w);
      nb_ratio.push_back(b / w);
    }
    if (rank == 0) {
      std::printf("| %lld KiB | %d | %.3f | %.3f | %.3f (%.3f-%.3f) | %.3f | %.3f |\n",
                  (long long)(shard * world * 4 / 1024), world, 1e3 * median(tr), 1e3 * median(te),
                  median(ratio), *std::min_element(ratio.begin(), ratio.end()),
                  *std::max_element(ratio.begin(), ratio.end()), 1e3 * median(tn),
                  median(nb_ratio));
      std::fflush(stdout);
    }
  }
  MPI_Comm_free(&raw);
  return 0;
}
