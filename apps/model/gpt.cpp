#include "model/gpt.hpp"

#include <algorithm>
#include <cmath>
#include <stdexcept>

#include "data/corpus.hpp"
#include "model/ops.hpp"

namespace zsdemo {

// Parameter order inside a block unit; backward and forward index params by these.
enum BlockParam {
  kLn1G,
  kLn1B,
  kAttnW,
  kAttnB,
  kProjW,
  kProjB,
  kLn2G,
  kLn2B,
  kFcW,
  kFcB,
  kFc2W,
  kFc2B
};

std::vector<UnitSpec> gpt_units(const GptShape& s) {
  const int64_t c = s.dim;
  std::vector<UnitSpec> units;
  units.push_back({"embed", {{"wte", {s.vocab, c}, true}, {"wpe", {s.seq, c}, true}}});
  for (int64_t l = 0; l < s.layers; ++l) {
    units.push_back({"block" + std::to_string(l),
                     {{"ln1.g", {c}, false},
                      {"ln1.b", {c}, false},
                      {"attn.w", {c, 3 * c}, true},
                      {"attn.b", {3 * c}, false},
                      {"proj.w", {c, c}, true},
                      {"proj.b", {c}, false},
                      {"ln2.g", {c}, false},
                      {"ln2.b", {c}, false},
                      {"fc.w", {c, 4 * c}, true},
                      {"fc.b", {4 * c}, false},
                      {"fc2.w", {4 * c, c}, true},
                      {"fc2.b", {c}, false}}});
  }
  units.push_back(
      {"head", {{"lnf.g", {c}, false}, {"lnf.b", {c}, false}, {"lm.w", {c, s.vocab}, true}}});
  return units;
}

int64_t gpt_param_count(const GptShape& s) {
  int64_t n = 0;
  for (const UnitSpec& u : gpt_units(s))
    for (const ParamSpec& p : u.params) {
      int64_t k = 1;
      for (int64_t d : p.shape) k *= d;
      n += k;
    }
  return n;
}

std::vector<std::vector<float>> gpt_init(const GptShape& s, const UnitSpec& unit, uint64_t seed) {
  std::vector<std::vector<float>> out;
  for (const ParamSpec& p : unit.params) {
    int64_t numel = 1;
    for (int64_t d : p.shape) numel *= d;
    std::vector<float> v(size_t(numel), 0.0f);
    const std::string key = unit.name + "/" + p.name;
    const bool gain = p.name.size() >= 2 && p.name.compare(p.name.size() - 2, 2, ".g") == 0;
    if (gain) {
      std::fill(v.begin(), v.end(), 1.0f);
    } else if (p.shape.size() == 2) {
      // A stream per parameter (FNV-1a of its full name): adding a layer does not shift the
      // values of the others.
      uint64_t h = 1469598103934665603ull ^ seed;
      for (char ch : key) h = (h ^ uint8_t(ch)) * 1099511628211ull;
      Rng r(h);
      double std = 0.02;
      if (p.name == "proj.w" || p.name == "fc2.w") std /= std::sqrt(2.0 * double(s.layers));
      for (float& x : v) x = float(std * r.normal());
    }
    out.push_back(std::move(v));
  }
  return out;
}

Gpt::Gpt(GptShape shape, int64_t max_batch) : s_(shape), max_batch_(max_batch) {
  if (s_.vocab < 1 || s_.seq < 1 || s_.dim < 1 || s_.layers < 0 || s_.heads < 1 ||
      s_.dim % s_.heads)
    throw std::invalid_argument("Gpt: bad shape (dim must be a multiple of heads)");
  const size_t n = size_t(max_batch * s_.seq), c = size_t(s_.dim), t = size_t(s_.seq);
  xs_.assign(size_t(s_.layers) + 1, std::vector<float>(n * c));
  cache_.resize(size_t(s_.layers));
  for (BlockCache& b : cache_) {
    b.ln1.resize(n * c), b.mean1.resize(n), b.rstd1.resize(n), b.qkv.resize(n * 3 * c);
    b.probs.resize(size_t(max_batch * s_.heads) * t * t), b.atty.resize(n * c),
        b.xmid.resize(n * c);
    b.ln2.resize(n * c), b.mean2.resize(n), b.rstd2.resize(n), b.fcpre.resize(n * 4 * c);
    b.fcact.resize(n * 4 * c);
  }
  lnf_.resize(n * c), meanf_.resize(n), rstdf_.resize(n), logits_.resize(n * size_t(s_.vocab));
  dres_.resize(n * c), dbig1_.resize(n * 4 * c), dbig2_.resize(n * 4 * c), dsmall_.resize(n * c);
  dqkv_.resize(n * 3 * c), att_scratch_.resize(t * t);
}

void Gpt::set_batch(const std::vector<int32_t>& inputs, const std::vector<int32_t>& targets,
                    int64_t batch) {
  if (batch < 1 || batch > max_batch_ || int64_t(inputs.size()) != batch * s_.seq ||
      (!targets.empty() && targets.size() != inputs.size()))
    throw std::invalid_argument("Gpt::set_batch: batch does not match the model's shape");
  for (int32_t id : inputs)
    if (id < 0 || id >= s_.vocab) throw std::invalid_argument("Gpt::set_batch: token out of range");
  inputs_ = inputs;
  targets_ = targets;
  batch_ = batch;
  have_targets_ = !targets.empty();
}

const float* Gpt::probs(int64_t row) const {
  return logits_.data() + row * s_.vocab;
}

void Gpt::forward_unit(int u, const std::vector<const float*>& p) {
  const int64_t n = batch_ * s_.seq, c = s_.dim;
  if (u == 0) {
    // x[n] = wte[token] + wpe[position]
    float* x = xs_[0].data();
    for (int64_t i = 0; i < n; ++i) {
      const float* te = p[0] + int64_t(inputs_[size_t(i)]) * c;
      const float* pe = p[1] + (i % s_.seq) * c;
      for (int64_t j = 0; j < c; ++j) x[i * c + j] = te[j] + pe[j];
    }
  } else if (u <= s_.layers) {
    block_forward(u - 1, p);
  } else {
    ops::layernorm_forward(xs_[size_t(s_.layers)].data(), p[0], p[1], lnf_.data(), meanf_.data(),
                           rstdf_.data(), n, c);
    ops::linear_forward(lnf_.data(), p[2], nullptr, logits_.data(), n, c, s_.vocab);
    if (have_targets_) {
      loss_ = ops::softmax_cross_entropy(logits_.data(), targets_.data(), n, s_.vocab);
    } else {
      // Inference: softmax without a loss (probs() reads it).
      std::vector<int32_t> zeros(size_t(n), 0);
      ops::softmax_cross_entropy(logits_.data(), zeros.data(), n, s_.vocab);
    }
  }
}

void Gpt::block_forward(int64_t l, const std::vector<const float*>& p) {
  const int64_t n = batch_ * s_.seq, c = s_.dim;
  BlockCache& k = cache_[size_t(l)];
  const float* x = xs_[size_t(l)].data();
  float* out = xs_[size_t(l) + 1].data();
  // Attention sub-block: xmid = x + proj(attention(ln1(x))).
  ops::layernorm_forward(x, p[kLn1G], p[kLn1B], k.ln1.data(), k.mean1.data(), k.rstd1.data(), n, c);
  ops::linear_forward(k.ln1.data(), p[kAttnW], p[kAttnB], k.qkv.data(), n, c, 3 * c);
  ops::attention_forward(k.qkv.data(), k.atty.data(), k.probs.data(), batch_, s_.seq, c, s_.heads);
  ops::linear_forward(k.atty.data(), p[kProjW], p[kProjB], k.xmid.data(), n, c, c);
  for (int64_t i = 0; i < n * c; ++i) k.xmid[size_t(i)] += x[i];
  // MLP sub-block: out = xmid + fc2(gelu(fc(ln2(xmid)))).
  ops::layernorm_forward(k.xmid.data(), p[kLn2G], p[kLn2B], k.ln2.data(), k.mean2.data(),
                         k.rstd2.data(), n, c);
  ops::linear_forward(k.ln2.data(), p[kFcW], p[kFcB], k.fcpre.data(), n, c, 4 * c);
  ops::gelu_forward(k.fcpre.data(), k.fcact.data(), n * 4 * c);
  ops::linear_forward(k.fcact.data(), p[kFc2W], p[kFc2B], out, n, 4 * c, c);
  for (int64_t i = 0; i < n * c; ++i) out[i] += k.xmid[size_t(i)];
}

void Gpt::backward_unit(int u, const std::vector<const float*>& p, const std::vector<float*>& g,
                        float loss_scale) {
  if (!have_targets_) throw std::logic_error("Gpt::backward_unit without targets");
  const int64_t n = batch_ * s_.seq, c = s_.dim;
  if (u == s_.layers + 1) {
    // Head: the loss scale enters here, so every gradient below is scaled (f16 loss scaling).
    ops::softmax_cross_entropy_backward(logits_.data(), targets_.data(), n, s_.vocab, loss_scale);
    ops::linear_backward(lnf_.data(), p[2], logits_.data(), dsmall_.data(), g[2], nullptr, n, c,
                         s_.vocab);
    std::fill(dres_.begin(), dres_.begin() + n * c, 0.0f);
    ops::layernorm_backward(xs_[size_t(s_.layers)].data(), p[0], meanf_.data(), rstdf_.data(),
                            dsmall_.data(), dres_.data(), g[0], g[1], n, c);
  } else if (u >= 1) {
    block_backward(u - 1, p, g);
  } else {
    // Embedding: scatter-add the residual gradient into the used rows.
    for (int64_t i = 0; i < n; ++i) {
      float* te = g[0] + int64_t(inputs_[size_t(i)]) * c;
      float* pe = g[1] + (i % s_.seq) * c;
      const float* d = dres_.data() + i * c;
      for (int64_t j = 0; j < c; ++j) {
        te[j] += d[j];
        pe[j] += d[j];
      }
    }
  }
}

void Gpt::block_backward(int64_t l, const std::vector<const float*>& p,
                         const std::vector<float*>& g) {
  const int64_t n = batch_ * s_.seq, c = s_.dim;
  BlockCache& k = cache_[size_t(l)];
  const float* x = xs_[size_t(l)].data();
  float* dres = dres_.data();  // ∂L/∂out on entry; ∂L/∂x on return
  // MLP: out = xmid + fc2(gelu(fc(ln2(xmid)))); the residual passes dres through unchanged.
  ops::linear_backward(k.fcact.data(), p[kFc2W], dres, dbig1_.data(), g[kFc2W], g[kFc2B], n, 4 * c,
                       c);
  ops::gelu_backward(k.fcpre.data(), dbig1_.data(), dbig2_.data(), n * 4 * c);
  ops::linear_backward(k.ln2.data(), p[kFcW], dbig2_.data(), dsmall_.data(), g[kFcW], g[kFcB], n, c,
                       4 * c);
  ops::layernorm_backward(k.xmid.data(), p[kLn2G], k.mean2.data(), k.rstd2.data(), dsmall_.data(),
                          dres, g[kLn2G], g[kLn2B], n, c);
  // Attention: xmid = x + proj(attention(ln1(x))).
  ops::linear_backward(k.atty.data(), p[kProjW], dres, dsmall_.data(), g[kProjW], g[kProjB], n, c,
                       c);
  ops::attention_backward(k.qkv.data(), k.probs.data(), dsmall_.data(), dqkv_.data(),
                          att_scratch_.data(), batch_, s_.seq, c, s_.heads);
  ops::linear_backward(k.ln1.data(), p[kAttnW], dqkv_.data(), dsmall_.data(), g[kAttnW], g[kAttnB],
                       n, c, 3 * c);
  ops::layernorm_backward(x, p[kLn1G], k.mean1.data(), k.rstd1.data(), dsmall_.data(), dres,
                          g[kLn1G], g[kLn1B], n, c);
}

}  // namespace zsdemo
