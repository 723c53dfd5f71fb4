#pragma once
// A small GPT (decoder-only transformer): token + position embedding, `layers` blocks of
// pre-norm causal self-attention and a GELU MLP with residual connections, a final layer norm
// and an untied output head. It has one engine unit per layer: "embed", "block0".., "head".
//
// The model owns activations and scratch only; parameters and gradients are handed in per unit
// as f32 pointers (one per parameter, in the unit's registration order), so the same code runs
// on the engine's gathered buffers, on converted copies of bf16/f16 ones, or on plain vectors
// in the gradient check.

#include <cstdint>
#include <string>
#include <vector>

namespace zsdemo {

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
/// Σ of every parameter's element count.
int64_t gpt_param_count(const GptShape& s);
/// GPT-2 style initial values of one unit, one vector per parameter: weights N(0, 0.02) (the
/// residual projections scaled by 1/√(2·layers)), gains 1, biases 0. Depends only on the seed and
/// the names, so every rank computes the same values.
std::vector<std::vector<float>> gpt_init(const GptShape& s, const UnitSpec& unit, uint64_t seed);

class Gpt {
 public:
  /// Activations are sized for up to `max_batch` sequences of shape.seq tokens.
  Gpt(GptShape shape, int64_t max_batch);

  const GptShape& shape() const { return s_; }
  int num_units() const { return int(s_.layers) + 2; }

  /// Sets the batch for the next forward: `batch` ≤ max_batch rows of seq tokens, and targets
  /// (same shape; may be empty for inference).
  void set_batch(const std::vector<int32_t>& inputs, const std::vector<int32_t>& targets,
                 int64_t batch);

  /// Runs unit `u`'s forward on the previous unit's output. The head computes the logits and,
  /// with targets, the loss.
  void forward_unit(int u, const std::vector<const float*>& params);
  /// Mean cross-entropy of the last forward (after the head ran with targets).
  double loss() const { return loss_; }
  /// Next-token probabilities at row `row` (after the head ran): vocab floats.
  const float* probs(int64_t row) const;

  /// Backward of unit `u`, last unit first, after a full forward with targets. Adds the
  /// gradients (of loss × loss_scale) into `grads`, which the caller zeroed.
  void backward_unit(int u, const std::vector<const float*>& params,
                     const std::vector<float*>& grads, float loss_scale);

 private:
  struct BlockCache {
    std::vector<float> ln1, mean1, rstd1, qkv, probs, atty, xmid, ln2, mean2, rstd2, fcpre, fcact;
  };
  void block_forward(int64_t l, const std::vector<const float*>& p);
  void block_backward(int64_t l, const std::vector<const float*>& p, const std::vector<float*>& g);

  GptShape s_;
  int64_t max_batch_, batch_ = 0;
  std::vector<int32_t> inputs_, targets_;
  std::vector<std::vector<float>> xs_;  // residual stream before block l (xs_[layers]: after all)
  std::vector<BlockCache> cache_;
  std::vector<float> lnf_, meanf_, rstdf_, logits_;
  std::vector<float> dres_, dbig1_, dbig2_, dsmall_, dqkv_, att_scratch_;  // backward scratch
  double loss_ = 0;
  bool have_targets_ = false;
};

}  // namespace zsdemo
