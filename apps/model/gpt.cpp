#include "apps/model/gpt.hpp"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <thread>
#include <vector>

#include "apps/data/corpus.hpp"
#include "apps/model/ops.hpp"
#include "apps/model/ops_cuda.hpp"
#include "zeroshard/device.hpp"

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

int gpt_group(const UnitSpec& u, const ParamSpec& p, bool muon) {
  if (!p.decay) return 1;
  return muon && (u.name == "embed" || p.name == "lm.w") ? 2 : 0;
}

std::vector<zeroshard::OptimizerOptions> gpt_groups(const zeroshard::OptimizerOptions& first,
                                                    float adamw_lr) {
  zeroshard::OptimizerOptions no_decay = first;
  no_decay.weight_decay = 0.0f;
  if (first.kind != zeroshard::OptimizerKind::muon) return {no_decay};
  zeroshard::OptimizerOptions adamw;
  adamw.kind = zeroshard::OptimizerKind::adamw;
  adamw.lr = adamw_lr;
  adamw.weight_decay = first.weight_decay;
  no_decay = adamw;
  no_decay.weight_decay = 0.0f;
  return {no_decay, adamw};
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
      double std = 0.02;
      if (p.name == "proj.w" || p.name == "fc2.w") std /= std::sqrt(2.0 * double(s.layers));
      // On every core, each from its own place in the one stream: the same values as one pass
      // (billions of parameters would otherwise take minutes to draw).
      const int64_t threads = std::clamp<int64_t>(std::thread::hardware_concurrency(), 1,
                                                  std::max<int64_t>(1, numel >> 20));
      std::vector<std::thread> pool;
      for (int64_t t = 0; t < threads; ++t)
        pool.emplace_back([&v, h, std, numel, threads, t] {
          const int64_t b = numel * t / threads, e = numel * (t + 1) / threads;
          Rng r(h);
          r.discard(2 * uint64_t(b));
          for (int64_t i = b; i < e; ++i) v[size_t(i)] = float(std * r.normal());
        });
      for (std::thread& th : pool) th.join();
    }
    out.push_back(std::move(v));
  }
  return out;
}

// ---- the model ------------------------------------------------------------------------------

// A layer call on the model's device: ops::fn(args…) on the CPU, gpu::fn(context, args…) on the
// GPU. Both take the same arguments (pointers into the activation arena, parameters, sizes).
#ifdef ZSDEMO_HAVE_CUDA
#define ZSDEMO_OP(cx, fn, ...) ((cx) ? gpu::fn(*(cx), __VA_ARGS__) : ops::fn(__VA_ARGS__))
#else
#define ZSDEMO_OP(cx, fn, ...) ((void)(cx), ops::fn(__VA_ARGS__))
#endif

// The GPU model's device state. Its int32 arrays hold the batch on the device: the tokens, the
// targets (zeros for inference, which only needs the softmax) and the rows grouped by token
// (CSR, for the embedding's deterministic backward).
struct Gpt::GpuState {
#ifdef ZSDEMO_HAVE_CUDA
  explicit GpuState(void* stream) : ctx(stream) {}
  gpu::Context ctx;
  zeroshard::DeviceBuffer arena;   // every activation
  zeroshard::DeviceBuffer ints;    // the int32 arrays below
  zeroshard::DeviceBuffer losses;  // [0]: the training loss; [1]: the unused one of inference
  std::vector<int32_t> tok_offsets_host, tok_rows_host, tok_fill;
  std::vector<float> probs_row;  // probs()'s host copy
#endif
  int32_t *inputs = nullptr, *targets = nullptr, *tok_rows = nullptr, *tok_offsets = nullptr;
  double* loss = nullptr;
};

namespace {
// Every activation array starts on a 64-float (256-byte) boundary of the arena: cuBLAS and
// coalescing like aligned rows; the CPU code does not care.
constexpr int64_t kArenaAlign = 64;
}  // namespace

Gpt::Gpt(GptShape shape, int64_t max_batch) : Gpt(shape, max_batch, zeroshard::Device::cpu) {}

Gpt::Gpt(GptShape shape, int64_t max_batch, zeroshard::Device device, void* stream)
    : s_(shape), max_batch_(max_batch), device_(device) {
  if (s_.vocab < 1 || s_.seq < 1 || s_.dim < 1 || s_.layers < 0 || s_.heads < 1 ||
      s_.dim % s_.heads)
    throw std::invalid_argument("Gpt: bad shape (dim must be a multiple of heads)");
  const bool on_gpu = device == zeroshard::Device::cuda;
#ifndef ZSDEMO_HAVE_CUDA
  (void)stream;
  if (on_gpu)
    throw std::invalid_argument(
        "Gpt: this build has no CUDA (configure with -DZEROSHARD_WITH_CUDA=ON)");
#endif
  const int64_t n = max_batch * s_.seq, c = s_.dim, t = s_.seq;

  // Plan one arena: each activation gets an aligned range, in this order.
  xs_.assign(size_t(s_.layers) + 1, nullptr);
  cache_.resize(size_t(s_.layers));
  std::vector<std::pair<float**, int64_t>> plan;
  auto want = [&plan](float*& ptr, int64_t floats) { plan.emplace_back(&ptr, floats); };
  for (float*& x : xs_) want(x, n * c);
  for (BlockCache& b : cache_) {
    want(b.ln1, n * c), want(b.mean1, n), want(b.rstd1, n), want(b.qkv, n * 3 * c);
    want(b.probs, max_batch * s_.heads * t * t), want(b.atty, n * c), want(b.xmid, n * c);
    want(b.ln2, n * c), want(b.mean2, n), want(b.rstd2, n), want(b.fcpre, n * 4 * c);
    want(b.fcact, n * 4 * c);
  }
  want(lnf_, n * c), want(meanf_, n), want(rstdf_, n), want(logits_, n * s_.vocab);
  want(dres_, n * c), want(dbig1_, n * 4 * c), want(dbig2_, n * 4 * c), want(dsmall_, n * c);
  // The CPU attention backward reuses one T×T block; the GPU one takes every head's at once.
  want(dqkv_, n * 3 * c), want(att_scratch_, on_gpu ? max_batch * s_.heads * t * t : t * t);
  int64_t total = 0;
  for (auto& [ptr, floats] : plan) total += (floats + kArenaAlign - 1) / kArenaAlign * kArenaAlign;

  float* base = nullptr;
#ifdef ZSDEMO_HAVE_CUDA
  if (on_gpu) {
    gpu_ = std::make_unique<GpuState>(stream);
    GpuState& g = *gpu_;
    const int dev = g.ctx.device();
    g.arena = zeroshard::DeviceBuffer(dev, size_t(total) * sizeof(float));
    // Zeroed like the CPU arena, so nothing ever reads undefined values.
    gpu::fill_zero(g.ctx, g.arena.data(), g.arena.bytes());
    base = g.arena.as<float>();
    g.ints = zeroshard::DeviceBuffer(dev, size_t(3 * n + s_.vocab + 1) * sizeof(int32_t));
    g.inputs = g.ints.as<int32_t>();
    g.targets = g.inputs + n;
    g.tok_rows = g.targets + n;
    g.tok_offsets = g.tok_rows + n;
    g.losses = zeroshard::DeviceBuffer(dev, 2 * sizeof(double));
    g.loss = g.losses.as<double>();
    g.ctx.synchronize();  // the zeroing is done before anyone else's stream can touch the arena
  }
#endif
  if (!on_gpu) {
    host_.assign(size_t(total), 0.0f);
    base = host_.data();
  }
  int64_t off = 0;
  for (auto& [ptr, floats] : plan) {
    *ptr = base + off;
    off += (floats + kArenaAlign - 1) / kArenaAlign * kArenaAlign;
  }
}

Gpt::~Gpt() = default;
Gpt::Gpt(Gpt&&) noexcept = default;
Gpt& Gpt::operator=(Gpt&&) noexcept = default;

bool Gpt::cuda_available(std::string* why) {
#ifdef ZSDEMO_HAVE_CUDA
  return zeroshard::cuda_device_count(why) > 0;
#else
  if (why) *why = "this build has no CUDA (configure with -DZEROSHARD_WITH_CUDA=ON)";
  return false;
#endif
}

gpu::Context* Gpt::ctx() const {
#ifdef ZSDEMO_HAVE_CUDA
  if (gpu_) return &gpu_->ctx;
#endif
  return nullptr;
}

void* Gpt::stream() const {
#ifdef ZSDEMO_HAVE_CUDA
  if (gpu_) return gpu_->ctx.stream();
#endif
  return nullptr;
}

void Gpt::set_stream(void* stream) {
#ifdef ZSDEMO_HAVE_CUDA
  if (gpu_) return gpu_->ctx.set_stream(stream);
#endif
  (void)stream;
  throw std::logic_error("Gpt::set_stream on a CPU model");
}

void Gpt::synchronize() const {
#ifdef ZSDEMO_HAVE_CUDA
  if (gpu_) gpu_->ctx.synchronize();
#endif
}

void Gpt::set_batch(const std::vector<int32_t>& inputs, const std::vector<int32_t>& targets,
                    int64_t batch) {
  if (batch < 1 || batch > max_batch_ || int64_t(inputs.size()) != batch * s_.seq ||
      (!targets.empty() && targets.size() != inputs.size()))
    throw std::invalid_argument("Gpt::set_batch: batch does not match the model's shape");
  for (int32_t id : inputs)
    if (id < 0 || id >= s_.vocab) throw std::invalid_argument("Gpt::set_batch: token out of range");
  for (int32_t id : targets)
    if (id < 0 || id >= s_.vocab)
      throw std::invalid_argument("Gpt::set_batch: target out of range");
  inputs_ = inputs;
  targets_ = targets;
  batch_ = batch;
  have_targets_ = !targets.empty();
#ifdef ZSDEMO_HAVE_CUDA
  if (gpu_) {
    GpuState& g = *gpu_;
    const int64_t n = batch * s_.seq;
    const size_t bytes = size_t(n) * sizeof(int32_t);
    gpu::copy_to_device(g.ctx, g.inputs, inputs_.data(), bytes);
    if (have_targets_)
      gpu::copy_to_device(g.ctx, g.targets, targets_.data(), bytes);
    else
      gpu::fill_zero(g.ctx, g.targets, bytes);
    // Rows grouped by token, ascending within a token (a counting sort).
    g.tok_offsets_host.assign(size_t(s_.vocab) + 1, 0);
    for (int32_t id : inputs_) ++g.tok_offsets_host[size_t(id) + 1];
    for (size_t v = 1; v < g.tok_offsets_host.size(); ++v)
      g.tok_offsets_host[v] += g.tok_offsets_host[v - 1];
    g.tok_fill.assign(g.tok_offsets_host.begin(), g.tok_offsets_host.end() - 1);
    g.tok_rows_host.resize(size_t(n));
    for (int64_t i = 0; i < n; ++i)
      g.tok_rows_host[size_t(g.tok_fill[size_t(inputs_[size_t(i)])]++)] = int32_t(i);
    gpu::copy_to_device(g.ctx, g.tok_rows, g.tok_rows_host.data(), bytes);
    gpu::copy_to_device(g.ctx, g.tok_offsets, g.tok_offsets_host.data(),
                        g.tok_offsets_host.size() * sizeof(int32_t));
  }
#endif
}

double Gpt::loss() const {
#ifdef ZSDEMO_HAVE_CUDA
  if (loss_on_device_) {
    gpu::copy_to_host(gpu_->ctx, &loss_, gpu_->loss, sizeof loss_);
    loss_on_device_ = false;
  }
#endif
  return loss_;
}

const float* Gpt::probs(int64_t row) const {
#ifdef ZSDEMO_HAVE_CUDA
  if (gpu_) {
    std::vector<float>& h = gpu_->probs_row;
    h.resize(size_t(s_.vocab));
    gpu::copy_to_host(gpu_->ctx, h.data(), logits_ + row * s_.vocab, h.size() * sizeof(float));
    return h.data();
  }
#endif
  return logits_ + row * s_.vocab;
}

void Gpt::forward_unit(int u, const std::vector<const float*>& p) {
  const int64_t n = batch_ * s_.seq, c = s_.dim;
  gpu::Context* cx = ctx();
  if (u == 0) {
#ifdef ZSDEMO_HAVE_CUDA
    if (cx) return gpu::embedding_forward(*cx, gpu_->inputs, p[0], p[1], xs_[0], n, s_.seq, c);
#endif
    // x[n] = wte[token] + wpe[position]
    float* x = xs_[0];
    for (int64_t i = 0; i < n; ++i) {
      const float* te = p[0] + int64_t(inputs_[size_t(i)]) * c;
      const float* pe = p[1] + (i % s_.seq) * c;
      for (int64_t j = 0; j < c; ++j) x[i * c + j] = te[j] + pe[j];
    }
  } else if (u <= s_.layers) {
    block_forward(u - 1, p);
  } else {
    ZSDEMO_OP(cx, layernorm_forward, xs_[size_t(s_.layers)], p[0], p[1], lnf_, meanf_, rstdf_, n,
              c);
    ZSDEMO_OP(cx, linear_forward, lnf_, p[2], nullptr, logits_, n, c, s_.vocab);
#ifdef ZSDEMO_HAVE_CUDA
    if (cx) {
      // The loss stays on the device until loss() asks; inference (zero targets) only needs the
      // softmax and writes its meaningless loss elsewhere.
      gpu::softmax_cross_entropy_async(*cx, logits_, gpu_->targets, n, s_.vocab,
                                       gpu_->loss + (have_targets_ ? 0 : 1));
      if (have_targets_) loss_on_device_ = true;
      return;
    }
#endif
    if (have_targets_) {
      loss_ = ops::softmax_cross_entropy(logits_, targets_.data(), n, s_.vocab);
    } else {
      // Inference: softmax without a loss (probs() reads it).
      std::vector<int32_t> zeros(size_t(n), 0);
      ops::softmax_cross_entropy(logits_, zeros.data(), n, s_.vocab);
    }
  }
}

void Gpt::block_forward(int64_t l, const std::vector<const float*>& p) {
  const int64_t n = batch_ * s_.seq, c = s_.dim;
  gpu::Context* cx = ctx();
  BlockCache& k = cache_[size_t(l)];
  const float* x = xs_[size_t(l)];
  float* out = xs_[size_t(l) + 1];
  // Attention sub-block: xmid = x + proj(attention(ln1(x))).
  ZSDEMO_OP(cx, layernorm_forward, x, p[kLn1G], p[kLn1B], k.ln1, k.mean1, k.rstd1, n, c);
  ZSDEMO_OP(cx, linear_forward, k.ln1, p[kAttnW], p[kAttnB], k.qkv, n, c, 3 * c);
  ZSDEMO_OP(cx, attention_forward, k.qkv, k.atty, k.probs, batch_, s_.seq, c, s_.heads);
  ZSDEMO_OP(cx, linear_forward, k.atty, p[kProjW], p[kProjB], k.xmid, n, c, c);
  ZSDEMO_OP(cx, add_inplace, k.xmid, x, n * c);
  // MLP sub-block: out = xmid + fc2(gelu(fc(ln2(xmid)))).
  ZSDEMO_OP(cx, layernorm_forward, k.xmid, p[kLn2G], p[kLn2B], k.ln2, k.mean2, k.rstd2, n, c);
  ZSDEMO_OP(cx, linear_forward, k.ln2, p[kFcW], p[kFcB], k.fcpre, n, c, 4 * c);
  ZSDEMO_OP(cx, gelu_forward, k.fcpre, k.fcact, n * 4 * c);
  ZSDEMO_OP(cx, linear_forward, k.fcact, p[kFc2W], p[kFc2B], out, n, 4 * c, c);
  ZSDEMO_OP(cx, add_inplace, out, k.xmid, n * c);
}

void Gpt::backward_unit(int u, const std::vector<const float*>& p, const std::vector<float*>& g,
                        float loss_scale) {
  if (!have_targets_) throw std::logic_error("Gpt::backward_unit without targets");
  const int64_t n = batch_ * s_.seq, c = s_.dim;
  gpu::Context* cx = ctx();
  if (u == s_.layers + 1) {
    // Head: the loss scale enters here, so every gradient below is scaled (f16 loss scaling).
    const int32_t* targets = cx ? gpu_->targets : targets_.data();
    ZSDEMO_OP(cx, softmax_cross_entropy_backward, logits_, targets, n, s_.vocab, loss_scale);
    ZSDEMO_OP(cx, linear_backward, lnf_, p[2], logits_, dsmall_, g[2], nullptr, n, c, s_.vocab);
#ifdef ZSDEMO_HAVE_CUDA
    if (cx) gpu::fill_zero(*cx, dres_, size_t(n * c) * sizeof(float));
#endif
    if (!cx) std::fill(dres_, dres_ + n * c, 0.0f);
    ZSDEMO_OP(cx, layernorm_backward, xs_[size_t(s_.layers)], p[0], meanf_, rstdf_, dsmall_, dres_,
              g[0], g[1], n, c);
  } else if (u >= 1) {
    block_backward(u - 1, p, g);
  } else {
#ifdef ZSDEMO_HAVE_CUDA
    if (cx)
      return gpu::embedding_backward(*cx, gpu_->tok_offsets, gpu_->tok_rows, dres_, g[0], g[1], n,
                                     s_.seq, c, s_.vocab);
#endif
    // Embedding: scatter-add the residual gradient into the used rows.
    for (int64_t i = 0; i < n; ++i) {
      float* te = g[0] + int64_t(inputs_[size_t(i)]) * c;
      float* pe = g[1] + (i % s_.seq) * c;
      const float* d = dres_ + i * c;
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
  gpu::Context* cx = ctx();
  BlockCache& k = cache_[size_t(l)];
  const float* x = xs_[size_t(l)];
  float* dres = dres_;  // ∂L/∂out on entry; ∂L/∂x on return
  // MLP: out = xmid + fc2(gelu(fc(ln2(xmid)))); the residual passes dres through unchanged.
  ZSDEMO_OP(cx, linear_backward, k.fcact, p[kFc2W], dres, dbig1_, g[kFc2W], g[kFc2B], n, 4 * c, c);
  ZSDEMO_OP(cx, gelu_backward, k.fcpre, dbig1_, dbig2_, n * 4 * c);
  ZSDEMO_OP(cx, linear_backward, k.ln2, p[kFcW], dbig2_, dsmall_, g[kFcW], g[kFcB], n, c, 4 * c);
  ZSDEMO_OP(cx, layernorm_backward, k.xmid, p[kLn2G], k.mean2, k.rstd2, dsmall_, dres, g[kLn2G],
            g[kLn2B], n, c);
  // Attention: xmid = x + proj(attention(ln1(x))).
  ZSDEMO_OP(cx, linear_backward, k.atty, p[kProjW], dres, dsmall_, g[kProjW], g[kProjB], n, c, c);
  ZSDEMO_OP(cx, attention_backward, k.qkv, k.probs, dsmall_, dqkv_, att_scratch_, batch_, s_.seq, c,
            s_.heads);
  ZSDEMO_OP(cx, linear_backward, k.ln1, p[kAttnW], dqkv_, dsmall_, g[kAttnW], g[kAttnB], n, c,
            3 * c);
  ZSDEMO_OP(cx, layernorm_backward, x, p[kLn1G], k.mean1, k.rstd1, dsmall_, dres, g[kLn1G],
            g[kLn1B], n, c);
}

}  // namespace zsdemo
