#pragma once
// The demo's training loop on the engine: per micro-step, forward unit by unit (gather, compute,
// release), backward in reverse (gather, compute, write gradients, grads_ready so the reduction
// overlaps the rest of backward, release), then step(). Also validation and text sampling.

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "apps/data/corpus.hpp"
#include "apps/model/gpt.hpp"
#include "zeroshard/zeroshard.hpp"

namespace zsdemo {

/// Registers the GPT's units (one per layer) with `engine` and finalizes it. Gains and biases
/// go to a parameter group without weight decay. `with_init`: pass GPT-2 initial values (the
/// data-parallel reference for the memory table registers without them).
void register_gpt(zeroshard::Engine& engine, const GptShape& shape, uint64_t seed, bool with_init);

/// One optimizer step as this rank saw it.
struct StepLog {
  int64_t step = 0;
  double loss = 0;  ///< mean over ranks and micro-steps (filled in when the step is logged)
  double local_loss = 0;
  float lr = 0;
  zeroshard::StepResult result;
  double compute_s = 0;  ///< trainer math (forward, backward, dtype conversions, batch sampling)
};

/// Binds the model to an engine: hands the model f32 views of each unit's parameters (converted
/// from bf16/f16 when needed) and writes its gradients back in the engine's dtype. On a GPU
/// (engine and model both on Device::cuda) the conversions run on the engine's compute stream,
/// where the model's work is queued too.
class UnitRunner {
 public:
  UnitRunner(zeroshard::Engine& engine, Gpt& model);
  /// Forward over every unit. With `keep_head`, the head stays gathered for backward (it is the
  /// first unit backward needs, so releasing and re-gathering it would waste an all-gather).
  void forward(bool keep_head);
  /// Backward, last unit first, after forward(true).
  void backward(float loss_scale);
  /// Seconds spent in the model's math and conversions since construction.
  double compute_s() const { return compute_s_; }

 private:
  std::vector<const float*> params_f32(int u, const std::vector<zeroshard::TensorView>& v);
  /// dst (f32) = src (dtype), on the CPU or on the engine's stream.
  void widen(const void* src, zeroshard::DType dt, float* dst, int64_t n);
  zeroshard::Engine& e_;
  Gpt& m_;
  zeroshard::DType dt_;
  std::vector<float> pbuf_, gbuf_;  // f32 copies of one unit (low-precision engines only)
  struct Device;                    // the same on the GPU
  std::shared_ptr<Device> gpu_;
  std::vector<zeroshard::TensorView> head_;
  double compute_s_ = 0;
};

struct TrainSettings {
  int64_t steps = 0, warmup = 0, batch = 0;
  int64_t first_step = 1;  ///< > 1: resuming after step first_step - 1
  float peak_lr = 0;
  /// Called on every rank after each step; may run collectives (all ranks call it alike).
  std::function<void(StepLog&)> on_step;
};

/// Runs the training loop; returns one StepLog per step.
std::vector<StepLog> train(zeroshard::Engine& engine, Gpt& model, BatchSampler& data,
                           const TrainSettings& settings);

/// Mean validation loss over all ranks (each rank evaluates its own held-out windows).
double validation_loss(zeroshard::Engine& engine, Gpt& model, const BatchSampler& data,
                       int64_t batch, zeroshard::Communicator& comm);

/// Generates `chars` characters after `prompt` (temperature 0.8, deterministic seed). Every
/// rank must call it: in stage 3 each forward gathers every unit.
std::string sample_text(zeroshard::Engine& engine, Gpt& model, const CharTokenizer& tok,
                        const std::string& prompt, int64_t chars, uint64_t seed);

/// The learning rate at `step` (1-based): linear warm-up, then cosine decay to peak / 10.
float lr_at(int64_t step, int64_t steps, int64_t warmup, float peak);

}  // namespace zsdemo
