#pragma once
// The optimizer state in memory: on the device tier (the engine's device: GPU memory, or host
// memory on a CPU-only engine) or on the host tier (pinned host memory, updated by the CPU), with
// the work done by the Compute backend that reaches it.

#include <array>
#include <atomic>
#include <functional>
#include <memory>
#include <optional>
#include <vector>

#include "base/ledger.hpp"
#include "kernels/cpu/arena.hpp"
#include "kernels/cpu/update_tasks.hpp"
#include "src/compute/compute.hpp"
#include "src/tiers/speculation.hpp"
#include "src/tiers/tier.hpp"

namespace zeroshard {

class MemoryStateTier final : public StateTier {
 public:
  /// State on `tier` (device or host), worked on by `compute` (the device's backend for the
  /// device tier, the CPU's for the host tier). master_alias[u], when set, is unit u's f32
  /// parameters in the same memory (null in a plan): they are the master weights, and no
  /// copy-out is made.
  /// `previews`: allocate the per-thread scratch preview() needs (CPU only, on `arena`).
  /// `speculative`: whether to take speculate() (the CPU's work only), with a second copy of
  /// the state of every unit whose master is its own (not the parameters), and whether its
  /// caller brings the memory for the new low-precision values (StagedStateTier).
  MemoryStateTier(const TierContext& ctx, Tier tier, Compute& compute, cpu::Arena& arena,
                  const std::vector<std::optional<float*>>& master_alias, bool previews,
                  Speculative speculative);

  void load_initial(int u, const float* whole) override;
  void* grad_target(int u) override { return units_[size_t(u)].grad_shard.data(); }
  void grad_reduced(int u, int micro, const void* whole) override;
  std::optional<Error> settle_grads() override;
  double sum_squares() override;
  void forget_grads() override;
  void update(const std::vector<cpu::UpdateHyper>& hyper, int64_t step, ParamSink& sink) override;
  bool speculates() const override { return !spec_.empty(); }
  void speculate(int u, const std::vector<cpu::UpdateHyper>& hyper, int64_t step,
                 void* out) override;
  SpeculationCount speculated() const override { return counted_; }
  void preview(const std::vector<cpu::UpdateHyper>& hyper, int64_t step, int u, void* out) override;
  std::vector<float> read(int u, StateKind kind) const override;
  std::vector<float> read_grad(int u) override;
  StoredShard stored(int u, StateKind kind) override;
  void write(int u, StateKind kind, const std::vector<float>& shard) override;
  void commit(Communicator& comm, ParamSink& sink) override;

 private:
  struct Unit {
    Buffer grad_shard, accum, master_buf, state0_buf, state1_buf, absmax0_buf, absmax1_buf;
    void* master = nullptr;  // master_buf (master_dtype_), or the f32 parameters
    void* state0 = nullptr;  // moments as Config::optimizer_state says
    void* state1 = nullptr;
    float* absmax0 = nullptr;  // q8: one per Config::state_block elements
    float* absmax1 = nullptr;
    const void* whole_grad = nullptr;  // stage 0: the all-reduced whole gradient
    double sumsq = 0;                  // on the CPU: Σ g² of this rank's final gradient
  };
  /// The gradient the update reads, from element 0 of the extent, and its dtype.
  std::pair<const void*, DType> grad(int u) const;
  /// Unit u's update in `step`, writing the low-precision copy to `out` (null: none).
  cpu::UnitUpdate unit_update(int u, void* out, int64_t step) const;
  /// Where this rank's shard of one state starts: element `off` of the extent, so that the
  /// state and, for q8, its absmax (off / state_block) can be addressed alike.
  int64_t shard_offset(int u) const;
  std::array<size_t, 6> preview_layout() const;
  /// preview() and run_speculation(): each task on copies of its chunk of the state's arrays.
  void run_on_copies(const std::vector<cpu::UpdateTask>& tasks,
                     const std::function<char*(int, const void*)>& place);
  /// This rank's shard of the master (master_dtype_) when `kind` is master, else null.
  char* master_at(int u, StateKind kind) const;
  void check_kind(const char* call, int u, StateKind kind) const;
  /// grad_reduced()'s CPU pass: the fold into the accumulator, the share of the norm.
  void take_grad(int u, int micro);
  /// On the speculation thread: unit u's update into its second copy (Speculation).
  void run_speculation(int u);
  /// update(): unit u's speculation becomes its state, its new values go to sink.target(u).
  void keep_speculation(int u, ParamSink& sink);
  /// Whether update(hyper, step) can keep unit u's speculation (what the update would read).
  bool matches(int u, const std::vector<cpu::UpdateHyper>& hyper, int64_t step) const;
  /// Cancels what the thread has not started, waits for it, then forgets what it computed
  /// (of unit u only).
  void drop_speculation();
  void drop_speculation(int u);

  TierContext ctx_;
  Compute& compute_;
  cpu::Arena& arena_;
  const bool on_cpu_;  // compute_ is the CPU's: the norm is taken as gradients arrive
  const StateFormat format_;
  const DType master_dtype_;  // f32, or bf16 (Config::bf16_master)
  std::vector<Unit> units_;
  Buffer scratch_;  // preview(): per-thread copies of one chunk of master and moments

  /// The speculative step, per unit (none: the tier does not speculate): the second copy of
  /// master, moments and absmax that run_speculation() writes and update() swaps in, the new
  /// low-precision values, and what the update read (kept only if the step's would read it).
  struct Speculation {
    Buffer master, state0, state1, absmax0, absmax1, own_out;
    void* out = nullptr;  // the new low-precision values: own_out, or the caller's
    bool posted = false;  // speculate() was called, and neither kept nor dropped yet
    bool ready = false;   // computed (by the thread; read after a settle())
    /// Set by the trainer's thread where the step will not keep it: the thread skips it.
    std::atomic<bool> cancel{false};
    std::vector<cpu::UpdateHyper> hyper;
    int64_t step = 0;
    std::vector<GroupRun> runs;
  };
  std::vector<Speculation> spec_;
  SpeculationCount counted_;
  int dropped_early_ = 0;     // by drop_speculation() (a write) since the last update or forget
  SpeculationThread thread_;  // last: joined before the memory it writes goes
};

}  // namespace zeroshard
