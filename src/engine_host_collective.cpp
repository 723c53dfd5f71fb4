// Engine: the f32 collectives outside the step's own (Muon's exchange, the full-state access of
// engine_state.cpp) on whichever communicator the engine holds. Over host memory: a host
// communicator takes the buffers as they are; NCCL's moves device memory only, so they go
// through the device, ordered by the compute stream as every other collective of the engine is.
// Over device memory (Muon's exchange with the state on a GPU): as the step's collectives.

#include <algorithm>

#include "base/pieces.hpp"
#include "src/compute/device_communicator.hpp"
#include "src/engine_impl.hpp"

namespace zeroshard {

std::shared_ptr<Work> Engine::Impl::start_collective(Communicator& on, CollectiveOp op,
                                                     const float* in, float* out, int64_t count,
                                                     const std::string& what) {
  switch (op) {
    case CollectiveOp::all_gather:
      return on.all_gather(in, out, count, DType::f32, what);
    case CollectiveOp::reduce_scatter:
      return on.reduce_scatter(in, out, count, DType::f32, what);
    case CollectiveOp::all_reduce_sum:
      break;
  }
  return on.all_reduce_sum(out, count, DType::f32, what);
}

void Engine::Impl::host_collective(Communicator& on, CollectiveOp op, const float* send,
                                   float* recv, int64_t count, const std::string& what,
                                   bool exposed) {
  if (count == 0) return;  // every rank's count is the same: nothing to move on any
  const auto wait = [&](Work& w) { exposed ? wait_for(w) : wait_crossing(w); };
  if (!as_device_communicator(&on)) {
    if (op == CollectiveOp::all_reduce_sum && send != recv) std::copy(send, send + count, recv);
    wait(*start_collective(on, op, send, recv, count, what));
    return;
  }
  const int64_t ranks = on.size();
  const size_t in = size_t(op == CollectiveOp::reduce_scatter ? count * ranks : count) * 4;
  const size_t out = size_t(op == CollectiveOp::all_gather ? count * ranks : count) * 4;
  Buffer up = tier_ctx.buffer(Tier::device, MemKind::buffer, "host_collective_in", in, false);
  Buffer down =
      op == CollectiveOp::all_reduce_sum
          ? Buffer()
          : tier_ctx.buffer(Tier::device, MemKind::buffer, "host_collective_out", out, false);
  float* dev_out = op == CollectiveOp::all_reduce_sum ? up.as<float>() : down.as<float>();
  res.dev->copy(up.data(), send, in);  // `send` stays untouched until the collective completed
  res.dev->before_collective();        // NCCL follows this engine's stream, not the last caller's
  wait(*start_collective(on, op, up.as<float>(), dev_out, count, what));
  res.dev->copy(recv, dev_out, out);
  // No wait here: freeing the staging buffers (on return) waits for every stream, as cudaFree
  // does, so `recv` has landed by then (scripts/mutate_waits.py found a download's wait
  // unneeded).
}

void Engine::Impl::device_collective(Communicator& on, CollectiveOp op, const float* send,
                                     float* recv, int64_t count, const std::string& what,
                                     bool exposed) {
  if (count == 0) return;
  if (op == CollectiveOp::all_reduce_sum && send != recv)
    res.dev->copy(recv, send, size_t(count) * 4);
  res.dev->before_collective();  // it follows what filled `send`
  const std::shared_ptr<Work> w = start_collective(on, op, send, recv, count, what);
  exposed ? wait_for(*w) : wait_crossing(*w);
}

void Engine::Impl::exchange_pieces(Communicator& on, bool on_device, const float* send,
                                   const Pieces& sends, float* recv, const Pieces& recvs,
                                   const std::string& what, bool exposed) {
  const auto wait = [&](Work& w) { exposed ? wait_for(w) : wait_crossing(w); };
  if (on_device) {
    res.dev->before_collective();  // it follows what filled `send`
    wait(*on.all_to_all(send, sends, recv, recvs, DType::f32, what));
    return;
  }
  if (!as_device_communicator(&on)) {
    wait(*on.all_to_all(send, sends, recv, recvs, DType::f32, what));
    return;
  }
  const int64_t in = pieces_extent(sends), out = pieces_extent(recvs);
  Buffer up, down;
  if (in > 0) {
    up =
        tier_ctx.buffer(Tier::device, MemKind::buffer, "host_collective_in", size_t(in) * 4, false);
    res.dev->copy(up.data(), send, size_t(in) * 4);
  }
  if (out > 0)
    down = tier_ctx.buffer(Tier::device, MemKind::buffer, "host_collective_out", size_t(out) * 4,
                           false);
  res.dev->before_collective();
  wait(*on.all_to_all(up.as<float>(), sends, down.as<float>(), recvs, DType::f32, what));
  for (size_t q = 0; q < recvs.counts.size(); ++q)
    if (recvs.counts[q] > 0)
      res.dev->copy(recv + recvs.offsets[q], down.as<float>() + recvs.offsets[q],
                    size_t(recvs.counts[q]) * 4);
  // As in host_collective(): freeing the buffers on return waits for the copies.
}

}  // namespace zeroshard
