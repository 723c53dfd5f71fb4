#pragma once
// The engine's private state, shared by engine.cpp (registration, layout, gather, gradients)
// and engine_step.cpp (reduction, norm, update).

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "layout.hpp"
#include "ledger.hpp"
#include "precision/loss_scaler.hpp"
#include "resources.hpp"
#include "zeroshard/engine.hpp"

namespace zeroshard {

/// A fixed pool of equal buffers (gradient staging, stage-3 gather): memory stays bounded by
/// count × the largest unit, whatever the model.
struct BufferPool {
  std::vector<Buffer> buffers;
  std::vector<int> owner;  // unit holding each buffer, -1 when free
  int acquire(int unit);   // a free slot or -1
  void release(int slot) { owner[size_t(slot)] = -1; }
};

struct Unit {
  UnitLayout layout;
  std::vector<Param> init_params;  // kept only until finalize() reads the initial values
  std::vector<GroupRun> shard_runs;  // this rank's shard, relative to the shard start
  std::vector<GroupRun> whole_runs;  // the whole unit (stage 0 updates it all)

  // Persistent state. Pointers alias into the buffers (or into another state, see finalize).
  Buffer param_buf, grad_buf, grad_shard_buf, accum_buf, master_buf, state0_buf, state1_buf;
  void* param = nullptr;       // stages 0–2: whole unit; stage 3: this rank's shard
  void* grad_whole = nullptr;  // stages 0–1: the trainer's whole gradient buffer
  void* grad_shard = nullptr;  // reduce-scatter output, this rank's shard
  float* accum = nullptr;      // f32 sum over micro-steps (stage 0: whole, else shard)
  float* master = nullptr;     // stage 0: whole, else shard
  float* state0 = nullptr;
  float* state1 = nullptr;

  // Per-step progress.
  std::shared_ptr<Work> reduction;  // reduce-scatter in flight
  bool grads_out = false;           // grads() handed out, grads_ready() not yet called
  int grad_slot = -1;               // stage 2–3 staging buffer in use
  int micro_done = 0;               // micro-steps reduced since the last step
  // Stage 3 gather state.
  int gather_slot = -1;
  std::shared_ptr<Work> gather_work;
  bool gathered = false;  // handed to the trainer (else, with a slot, it is a prefetch)
};

struct Engine::Impl {
  Config cfg;
  std::shared_ptr<Communicator> comm;
  int rank = 0, world = 1;
  std::vector<OptimizerOptions> groups;
  std::vector<Unit> units;
  bool finalized = false;

  Resources res;
  Ledger ledger;
  LossScaler scaler;
  int64_t steps = 0;
  DType pdt = DType::f32;  // parameter and gradient dtype
  size_t pbytes = 4;

  BufferPool grad_pool;    // stages 2–3
  BufferPool gather_pool;  // stage 3
  // Stage 3 prefetch: the gather order recorded during the first step, and where we are in it.
  std::vector<int> gather_order;
  bool order_recorded = false;
  size_t gather_pos = 0;

  // Timing of the current step interval (StepResult's breakdown).
  std::vector<std::shared_ptr<Work>> step_works;  // collectives since the last step
  double exposed_s = 0;                           // trainer thread blocked on them
  double interval_start = 0;

  Impl(Config c, std::shared_ptr<Communicator> cm);

  /// Records a collective of the step path for the busy-time union.
  std::shared_ptr<Work> track(std::shared_ptr<Work> w) {
    step_works.push_back(w);
    return w;
  }
  /// Waits for a collective, counting the wait as exposed communication.
  void wait_for(Work& w);

  Unit& unit(UnitId id, const char* call);
  const Unit& unit(UnitId id, const char* call) const;
  std::string where(const Unit& u) const;  // "rank 1, unit 'layer3'"
  int num_states() const;                  // optimizer moment buffers: 0, 1 or 2
  std::vector<TensorView> views(const Unit& u, void* base) const;

  // engine.cpp
  void check_same_model();
  void allocate();
  void load_initial_values();
  int take_gather_slot(int unit);
  void start_gather(int id);
  void prefetch_after(int id);

  // engine_step.cpp
  void finish_reduction(int id);
  StepResult step();
};

}  // namespace zeroshard
