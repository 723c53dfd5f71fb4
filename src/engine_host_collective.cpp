// Engine: collectives over host memory (Muon's exchange, the full-state access of
// engine_state.cpp) on whichever communicator the engine holds: a host communicator takes the
// host buffers as they are; NCCL's moves device memory only, so the buffers go through the
// device, ordered by the compute stream as every other collective of the engine is.

#include <algorithm>

#include "src/compute/device_communicator.hpp"
#include "src/engine_impl.hpp"

namespace zeroshard {

void Engine::Impl::host_collective(Communicator& on, HostOp op, const float* send, float* recv,
                                   int64_t count, const std::string& what, bool exposed) {
  if (count == 0) return;  // every rank's count is the same: nothing to move on any
  const auto wait = [&](Work& w) { exposed ? wait_for(w) : wait_crossing(w); };
  const auto start = [&](const float* in, float* out) {
    switch (op) {
      case HostOp::all_gather:
        return on.all_gather(in, out, count, DType::f32, what);
      case HostOp::reduce_scatter:
        return on.reduce_scatter(in, out, count, DType::f32, what);
      case HostOp::all_reduce_sum:
        break;
    }
    return on.all_reduce_sum(out, count, DType::f32, what);
  };
  if (!as_device_communicator(&on)) {
    if (op == HostOp::all_reduce_sum && send != recv) std::copy(send, send + count, recv);
    wait(*start(send, recv));
    return;
  }
  const int64_t ranks = on.size();
  const size_t in = size_t(op == HostOp::reduce_scatter ? count * ranks : count) * 4;
  const size_t out = size_t(op == HostOp::all_gather ? count * ranks : count) * 4;
  Buffer up = tier_ctx.buffer(Tier::device, MemKind::buffer, "host_collective_in", in, false);
  Buffer down = op == HostOp::all_reduce_sum ? Buffer()
                                             : tier_ctx.buffer(Tier::device, MemKind::buffer,
                                                               "host_collective_out", out, false);
  float* dev_out = op == HostOp::all_reduce_sum ? up.as<float>() : down.as<float>();
  res.dev->copy(up.data(), send, in);  // `send` stays untouched until the collective completed
  res.dev->before_collective();        // NCCL follows this engine's stream, not the last caller's
  wait(*start(up.as<float>(), dev_out));
  res.dev->copy(recv, dev_out, out);
  // No wait here: freeing the staging buffers (on return) waits for every stream, as cudaFree
  // does, so `recv` has landed by then (scripts/mutate_waits.py found a download's wait
  // unneeded).
}

}  // namespace zeroshard
