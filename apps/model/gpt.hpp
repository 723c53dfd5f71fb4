#pragma once
// A small GPT (decoder-only transformer): token + position embedding, `layers` blocks of
// pre-norm causal self-attention and a GELU MLP with residual connections, a final layer norm
// and an untied output head. It has one engine unit per layer: "embed", "block0".., "head".
//
// The model owns activations and scratch only; parameters and gradients are handed in per unit
// as f32 pointers (one per parameter, in the unit's registration order), so the same code runs
// on the engine's gathered buffers, on converted copies of bf16/f16 ones, or on plain vectors
// in the gradient check.
//
// It runs on the CPU (ops.hpp, OpenBLAS) or, in a build with CUDA (ZSDEMO_HAVE_CUDA), on a GPU
// (ops_cuda.hpp, cuBLAS): one implementation of the layer sequence, two sets of layer kernels.

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "zeroshard/config.hpp"
#include "zeroshard/types.hpp"

namespace zsdemo {

namespace gpu {
class Context;  // ops_cuda.hpp
}

struct GptShape {
  int64_t vocab = 0;   ///< tokens in the vocabulary
  int64_t seq = 0;     ///< context length T (positions)
  int64_t dim = 0;     ///< channels C
  int64_t layers = 0;  ///< transformer blocks
  int64_t heads = 0;   ///< attention heads; must divide dim
};

struct ParamSpec {
  std::string name;
  std::vector<int64_t> shape;
  bool decay = false;  ///< weight matrices and embeddings take weight decay; gains and biases not
};
struct UnitSpec {
  std::string name;
  std::vector<ParamSpec> params;
};

/// The units in registration (= forward) order.
std::vector<UnitSpec> gpt_units(const GptShape& s);
/// The parameter group the demo trains `p` of unit `u` in: 1 for the gains and biases (no
/// weight decay); with Muon, 2 for the embeddings and the output head (AdamW beside Muon, as
/// Muon's authors train them); else 0 (the blocks' matrices: Muon's with Muon).
int gpt_group(const UnitSpec& u, const ParamSpec& p, bool muon);
/// The groups after the first that gpt_group() names, for a first group `first`: group 1 is
/// `first` without weight decay; with Muon, groups 1 and 2 are AdamW's at `adamw_lr`, group 1
/// without weight decay and group 2 with first's.
std::vector<zeroshard::OptimizerOptions> gpt_groups(const zeroshard::OptimizerOptions& first,
                                                    float adamw_lr);
/// Σ of every parameter's element count.
int64_t gpt_param_count(const GptShape& s);
/// GPT-2 style initial values of one unit, one vector per parameter: weights N(0, 0.02) (the
/// residual projections scaled by 1/√(2·layers)), gains 1, biases 0. Depends only on the seed and
/// the names, so every rank computes the same values.
std::vector<std::vector<float>> gpt_init(const GptShape& s, const UnitSpec& unit, uint64_t seed);

/// The GPT's forward and backward, unit by unit.
///
/// CPU model (`Gpt(shape, max_batch)`): activations in host memory; every pointer passed in is
/// host memory; every call computes synchronously.
///
/// GPU model (`Gpt(shape, max_batch, zeroshard::Device::cuda, stream)`), in a build with CUDA:
///  - activations live in device memory of the CUDA device current at construction (allocated
///    once there, freed with the model); that device must be current whenever the model is used;
///  - the `params` and `grads` pointers of forward_unit/backward_unit are DEVICE pointers with
///    the same layout as on the CPU (f32, one per parameter in registration order), e.g. the
///    engine's device-tier views of an f32 unit (`TensorView::as<float>()`);
///  - forward_unit/backward_unit only ENQUEUE their work on `stream` (a cudaStream_t; nullptr =
///    the legacy default stream) and return. The caller orders on that stream whatever produces
///    the parameters (a gather) before the call, and whatever consumes the gradients (a
///    reduction) after it: the gradients are complete when the stream reaches that point. Passing
///    the engine's compute stream does both;
///  - set_batch copies the tokens to the device on the stream (no wait);
///  - loss() and probs() return host values: they wait for the stream (loss() once per forward;
///    calling it after backward_unit lets the backward be enqueued before the wait).
/// Without CUDA, the GPU constructor throws std::invalid_argument; cuda_available() says false.
class Gpt {
 public:
  /// A CPU model: activations sized for up to `max_batch` sequences of shape.seq tokens.
  Gpt(GptShape shape, int64_t max_batch);
  /// A model on `device` (Device::cpu is the constructor above). Device::cuda: see the class
  /// comment; `stream` is a cudaStream_t the caller owns and keeps alive (ignored for cpu).
  Gpt(GptShape shape, int64_t max_batch, zeroshard::Device device, void* stream = nullptr);
  ~Gpt();
  Gpt(Gpt&&) noexcept;
  Gpt& operator=(Gpt&&) noexcept;
  Gpt(const Gpt&) = delete;
  Gpt& operator=(const Gpt&) = delete;

  /// True when this build has CUDA and a GPU is usable; else false with the reason in *why.
  static bool cuda_available(std::string* why = nullptr);

  const GptShape& shape() const { return s_; }
  int num_units() const { return int(s_.layers) + 2; }
  zeroshard::Device device() const { return device_; }
  /// GPU model: the stream the model enqueues on (nullptr on the CPU).
  void* stream() const;
  /// GPU model: enqueue later work on `stream`; waits for the work on the old one first.
  void set_stream(void* stream);
  /// GPU model: blocks until the model's enqueued work is done (no-op on the CPU).
  void synchronize() const;

  /// Sets the batch for the next forward: `batch` ≤ max_batch rows of seq tokens, and targets
  /// (same shape; may be empty for inference). Host vectors on both devices.
  void set_batch(const std::vector<int32_t>& inputs, const std::vector<int32_t>& targets,
                 int64_t batch);

  /// Runs unit `u`'s forward on the previous unit's output. The head computes the logits and,
  /// with targets, the loss.
  void forward_unit(int u, const std::vector<const float*>& params);
  /// Mean cross-entropy of the last forward (after the head ran with targets). GPU model: waits
  /// for the stream to reach the end of that forward.
  double loss() const;
  /// Next-token probabilities at row `row` (after the head ran): vocab floats in host memory.
  /// GPU model: waits for the stream and copies the row into a host buffer of the model, valid
  /// until the next call of probs().
  const float* probs(int64_t row) const;

  /// Backward of unit `u`, last unit first, after a full forward with targets. Adds the
  /// gradients (of loss × loss_scale) into `grads`, which the caller zeroed.
  void backward_unit(int u, const std::vector<const float*>& params,
                     const std::vector<float*>& grads, float loss_scale);

 private:
  // Pointers into one activation arena (host_ on the CPU, device memory on the GPU).
  struct BlockCache {
    float *ln1, *mean1, *rstd1, *qkv, *probs, *atty, *xmid, *ln2, *mean2, *rstd2, *fcpre, *fcact;
  };
  struct GpuState;            // CUDA context, device arena and the batch on the device (gpt.cpp)
  gpu::Context* ctx() const;  // the GPU model's context; nullptr on the CPU
  void block_forward(int64_t l, const std::vector<const float*>& p);
  void block_backward(int64_t l, const std::vector<const float*>& p, const std::vector<float*>& g);

  GptShape s_;
  int64_t max_batch_, batch_ = 0;
  zeroshard::Device device_ = zeroshard::Device::cpu;
  std::vector<int32_t> inputs_, targets_;
  std::vector<float> host_;        // CPU: every activation below, zero-initialised
  std::unique_ptr<GpuState> gpu_;  // GPU only
  std::vector<float*> xs_;         // residual stream before block l (xs_[layers]: after all)
  std::vector<BlockCache> cache_;
  float *lnf_ = nullptr, *meanf_ = nullptr, *rstdf_ = nullptr, *logits_ = nullptr;
  // Backward scratch.
  float *dres_ = nullptr, *dbig1_ = nullptr, *dbig2_ = nullptr, *dsmall_ = nullptr,
        *dqkv_ = nullptr, *att_scratch_ = nullptr;
  mutable double loss_ = 0;
  mutable bool loss_on_device_ = false;  // GPU: the last loss is still in device memory
  bool have_targets_ = false;
};

}  // namespace zsdemo
