#pragma once
// The engine's private state, shared by engine.cpp (registration, layout, gather, gradients)
// and engine_step.cpp (reduction, norm, update).

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "src/compute.hpp"
#include "src/base/layout.hpp"
#include "src/base/ledger.hpp"
#include "src/precision/loss_scaler.hpp"
#include "src/resources.hpp"
#include "zeroshard/engine.hpp"
#include "zeroshard/error.hpp"

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
  std::vector<Param> init_params;    // kept only until finalize() reads the initial values
  std::vector<GroupRun> shard_runs;  // this rank's shard, relative to the shard start
  std::vector<GroupRun> whole_runs;  // the whole unit (stage 0 updates it all)

  // Persistent state. Pointers alias into the buffers (or into another state, see finalize).
  Buffer param_buf, grad_buf, grad_shard_buf, accum_buf, master_buf, state0_buf, state1_buf;
  // GPU with the optimizer on the host tier: the update's low-precision copy of this rank's
  // shard, uploaded to the parameters on the GPU.
  Buffer param_upload_buf;
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
  int shard_slot = -1;              // GPU + host tier: device buffer the reduce-scatter fills
  int micro_done = 0;               // micro-steps reduced since the last step
  // Stage 3 gather state.
  int gather_slot = -1;
  std::shared_ptr<Work> gather_work;
  bool gathered = false;  // handed to the trainer (else, with a slot, it is a prefetch)
};

struct NvmeState;
struct RecordLayout;

struct Engine::Impl {
  Config cfg;
  std::shared_ptr<Communicator> comm;
  int rank = 0, world = 1;
  std::vector<OptimizerOptions> groups;
  Resources res;
  // The device's backend and the CPU's (the host tier's optimizer). Declared before the
  // ledger and every Buffer: members die in reverse order, and buffers return their memory to
  // the backends' allocators and unregister from the ledger when they die.
  std::unique_ptr<Compute> dev, host;
  Ledger ledger;
  std::vector<Unit> units;
  bool finalized = false;

  LossScaler scaler;
  int64_t steps = 0;
  DType pdt = DType::f32;  // parameter and gradient dtype
  size_t pbytes = 4;

  BufferPool grad_pool;          // stages 2–3
  BufferPool gather_pool;        // stage 3
  BufferPool shard_pool;         // GPU + host tier: reduce-scatter outputs on the GPU
  bool uploads_pending = false;  // param_upload_bufs still being copied to the GPU
  // Stage 3 prefetch: the gather order recorded during the first step, and where we are in it.
  std::vector<int> gather_order;
  bool order_recorded = false;
  size_t gather_pos = 0;

  // Timing of the current step interval (StepResult's breakdown).
  std::vector<std::shared_ptr<Work>> step_works;  // collectives since the last step
  double exposed_s = 0;                           // trainer thread blocked on them
  double interval_start = 0;

  // The nvme tier (engine_offload.cpp); null without one. After the pools it stages into.
  std::unique_ptr<NvmeState> nv;

  Impl(Config c, std::shared_ptr<Communicator> cm);
  ~Impl();

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
  /// Where the optimizer state lives decides where its work runs.
  Compute& opt_compute() const { return cfg.offload_optimizer.tier == Tier::device ? *dev : *host; }
  /// GPU with the optimizer on the host or nvme tier (run by the CPU): gradient shards come
  /// down, updated parameters go up.
  bool staged() const {
    return dev->device() != Device::cpu && cfg.offload_optimizer.tier != Tier::device;
  }
  /// n low-precision parameters at dst (device memory) rounded from f32 values in host memory;
  /// returns once the values may be reused. Off the step path (set-up, restore).
  void write_params(void* dst, const float* values, int64_t n);
  /// The update of unit u wrote its low-precision shard to its upload buffer: send it up.
  void upload_params(Unit& u) {
    dev->copy(own_param(u), u.param_upload_buf.data(), u.param_upload_buf.bytes());
    uploads_pending = true;
  }
  std::vector<TensorView> views(const Unit& u, void* base) const;
  /// Where this rank's updated shard of the low-precision parameters goes: its block of the
  /// whole parameters (stages 1–2), the shard itself (stage 3) or the whole unit (stage 0).
  void* own_param(const Unit& u) const {
    return static_cast<char*>(u.param) +
           size_t(cfg.stage == 1 || cfg.stage == 2 ? rank * u.layout.shard_numel : 0) * pbytes;
  }

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
  std::vector<cpu::UpdateHyper> fold_hyper(double grad_scale) const;
  /// One unit's update: the state at master/state0/state1 (shard-relative, or whole in stage 0),
  /// the gradient at grad (grad_dtype) and the low-precision copy-out at out (null: none).
  UnitUpdate unit_update(const Unit& u, float* master, float* state0, float* state1,
                         const void* grad, DType grad_dtype, void* out) const;
  /// The same as CPU tasks of at most Resources::kChunk elements (the nvme tier).
  void unit_tasks(const Unit& u, const std::vector<cpu::UpdateHyper>& hyper, float* master,
                  float* state0, float* state1, const void* grad, DType grad_dtype, void* out,
                  std::vector<UpdateTask>& tasks) const;

  // engine_offload.cpp: the nvme tier.
  bool opt_nvme() const;
  bool par_nvme() const;
  /// Every rank learns whether any rank failed (`mine`); returns the first failing rank's error
  /// as this rank should throw it, or nothing. Collective.
  std::optional<Error> agree(const std::optional<Error>& mine, const std::string& what);
  std::string not_applied(int64_t step) const;  // the note a failed step's error ends with
  void nvme_setup();
  void nvme_load_initial(int id,
                         const float* whole);  // whole: the padded unit in f32, or null (zeros)
  void nvme_finish_load();
  RecordLayout record_layout(const Unit& u) const;
  void nvme_grad_target(int id);             // grads_ready(): where the reduce-scatter writes
  void nvme_grad_reduced(int id);            // finish_reduction(): accumulate, norm, cache
  void nvme_forget_grads();                  // zero_grad() and after step()
  std::optional<Error> nvme_settle_grads();  // step(): every gradient on disk or in memory
  double nvme_sumsq() const;
  void nvme_update(const std::vector<cpu::UpdateHyper>& hyper);        // optimizer on nvme
  void nvme_param_update(const std::vector<cpu::UpdateHyper>& hyper);  // params only on nvme
  const void* nvme_param_source(int id);  // stage 3 gather: the shard, read and agreed on
  void nvme_param_read_ahead();
  void nvme_param_done(int id);  // the unit's all-gather finished: free its staging
  void nvme_drop_param_reads();
  std::vector<float> nvme_read_state(const Unit& u, StateKind kind) const;
  void nvme_write_state(Unit& u, StateKind kind, const std::vector<float>& values);
  void nvme_commit_shards();
};

}  // namespace zeroshard
