// time_collectives() (zeroshard/calibration.hpp): the collectives' points of a calibration.
#include <algorithm>
#include <vector>

#include "src/planner/timing.hpp"
#include "zeroshard/calibration.hpp"

namespace zeroshard {

using timing::median;
using timing::now_s;

CollectiveTimes time_collectives(Communicator& comm, int64_t bytes, DType dtype, int reps) {
  constexpr int64_t kRing = int64_t(256) << 20, kQueue = 16;
  const int64_t n = bytes / int64_t(dtype_size(dtype)), world = comm.size();
  const int64_t k = std::max<int64_t>(1, kRing / (bytes * world));  // the ring's buffers
  // 0x3C3C: a finite value in bf16, f16 and f32.
  std::vector<uint8_t> send(size_t(bytes * world * k), 0x3C), recv(send.size());
  auto sd = [&](int64_t slot) { return send.data() + size_t(slot * bytes * world); };
  auto rv = [&](int64_t slot) { return recv.data() + size_t(slot * bytes * world); };
  const char* what = "calibrate";
  // t[0..2] warm, t[3..5] cold, t[6..7] queued.
  std::vector<double> t[8];
  auto timed = [&](std::vector<double>& into, int r, auto op) {
    comm.barrier(what);
    const double t0 = now_s();
    op();
    if (r > 0) into.push_back(now_s() - t0);
  };
  for (int r = 0; r < reps + 1; ++r)
    for (int cold = 0; cold < 2; ++cold) {
      const int64_t at = cold ? r % k : 0;
      std::vector<double>* into = t + 3 * cold;
      timed(into[0], r, [&] { comm.reduce_scatter(sd(at), rv(at), n, dtype, what)->wait(); });
      timed(into[1], r, [&] { comm.all_gather(rv(at), sd(at), n, dtype, what)->wait(); });
      timed(into[2], r, [&] { comm.all_reduce_sum(sd(at), n, dtype, what)->wait(); });
    }
  const int64_t q = std::min(kQueue, k);
  for (int r = 0; r < reps + 1; ++r)
    for (int c = 0; c < 2; ++c)
      timed(t[6 + c], r, [&] {
        std::vector<std::shared_ptr<Work>> started;
        for (int64_t i = 0; i < q; ++i)
          started.push_back(c == 0 ? comm.reduce_scatter(sd(i), rv(i), n, dtype, what)
                                   : comm.all_gather(rv(i), sd(i), n, dtype, what));
        for (const std::shared_ptr<Work>& w : started) w->wait();
      });
  // The slowest rank's median: a collective ends when the last rank is done.
  double m[8];
  for (int i = 0; i < 8; ++i) m[i] = median(t[i]);
  comm.all_reduce(m, 8, ReduceOp::max, what)->wait();
  CollectiveTimes out;
  for (int c = 0; c < 3; ++c) {
    out.warm[c] = m[c];
    out.cold[c] = m[3 + c];
  }
  out.queued[0] = m[6] / double(q);
  out.queued[1] = m[7] / double(q);
  return out;
}

}  // namespace zeroshard
