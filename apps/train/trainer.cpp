#include "apps/train/trainer.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <stdexcept>

#include "apps/model/precision.hpp"
#include "zeroshard/device.hpp"
#ifdef ZSDEMO_HAVE_CUDA
#include "apps/model/ops_cuda.hpp"
#endif

namespace zsdemo {

using zeroshard::DType;
using zeroshard::Engine;
using zeroshard::TensorView;

namespace {

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// Adds the wall time of its scope to a counter.
struct Timed {
  double& total;
  double t0 = now_s();
  ~Timed() { total += now_s() - t0; }
};

// A view of n elements of type dt at p in the memory of CUDA device `device`.
[[maybe_unused]] TensorView cuda_view(const void* p, DType dt, int64_t n, int device) {
  return {const_cast<void*>(p), n, dt, zeroshard::Device::cuda, device};
}

}  // namespace

// With Muon, the peak learning rate of the AdamW groups beside it (the schedule scales it).
constexpr float kMuonAdamLr = 2e-3f;

void register_gpt(Engine& engine, const GptShape& shape, uint64_t seed, bool with_init) {
  // Group 1: no weight decay (layer-norm gains, biases), as GPT trainers usually do. With Muon,
  // the blocks' matrices are Muon's (group 0); the embeddings and the output head (group 2) and
  // the vectors (group 1) are AdamW's, as Muon's authors train them (gpt_group()).
  const bool muon = engine.config().optimizer.kind == zeroshard::OptimizerKind::muon;
  for (const zeroshard::OptimizerOptions& g : gpt_groups(engine.config().optimizer, kMuonAdamLr))
    engine.add_group(g);
  std::vector<std::vector<float>> keep;  // initial values must live until finalize()
  for (const UnitSpec& u : gpt_units(shape)) {
    std::vector<std::vector<float>> init;
    if (with_init) init = gpt_init(shape, u, seed);
    std::vector<zeroshard::Param> params;
    for (size_t i = 0; i < u.params.size(); ++i) {
      zeroshard::Param p{u.params[i].name, u.params[i].shape, gpt_group(u, u.params[i], muon)};
      if (with_init) {
        keep.push_back(std::move(init[i]));
        p.init = {keep.back().data(), int64_t(keep.back().size()), DType::f32};
      }
      params.push_back(std::move(p));
    }
    engine.add_unit(u.name, std::move(params));
  }
  engine.finalize();
}

// f32 copies of one unit in GPU memory, and the stream the engine and the model share.
struct UnitRunner::Device {
#ifdef ZSDEMO_HAVE_CUDA
  gpu::Context ctx;
  zeroshard::DeviceBuffer pbuf, gbuf;
  Device(void* stream, int64_t largest)
      : ctx(stream),
        pbuf(ctx.device(), size_t(largest) * 4),
        gbuf(ctx.device(), size_t(largest) * 4) {}
#endif
};

UnitRunner::UnitRunner(Engine& engine, Gpt& model)
    : e_(engine), m_(model), dt_(engine.config().dtype) {
  if (model.device() != engine.config().device)
    throw std::invalid_argument("the demo model and the engine must be on the same device");
  if (dt_ == DType::f32) return;
  int64_t largest = 0;
  for (int u = 0; u < e_.num_units(); ++u) largest = std::max(largest, e_.shard_info(u).numel);
  if (model.device() == zeroshard::Device::cuda) {
#ifdef ZSDEMO_HAVE_CUDA
    gpu_ = std::make_shared<Device>(engine.stream(), largest);
#endif
    return;
  }
  pbuf_.resize(size_t(largest));
  gbuf_.resize(size_t(largest));
}

void UnitRunner::widen(const void* src, DType dt, float* dst, int64_t n) {
#ifdef ZSDEMO_HAVE_CUDA
  if (gpu_) {
    const int dev = gpu_->ctx.device();
    return zeroshard::convert(cuda_view(src, dt, n, dev), cuda_view(dst, DType::f32, n, dev),
                              e_.stream());
  }
#endif
  to_f32(src, dt, dst, n);
}

std::vector<const float*> UnitRunner::params_f32(int, const std::vector<TensorView>& v) {
  std::vector<const float*> p;
  if (dt_ == DType::f32) {
    // The engine's own buffers: no copy.
    for (const TensorView& t : v) p.push_back(t.as<float>());
    return p;
  }
  // A unit's parameters lie back to back; convert them into the same layout in f32.
  float* base = pbuf_.data();
#ifdef ZSDEMO_HAVE_CUDA
  if (gpu_) base = gpu_->pbuf.as<float>();
#endif
  size_t off = 0;
  for (const TensorView& t : v) {
    widen(t.data, t.dtype, base + off, t.numel);
    p.push_back(base + off);
    off += size_t(t.numel);
  }
  return p;
}

void UnitRunner::forward(bool keep_head) {
  const int last = m_.num_units() - 1;
  for (int u = 0; u <= last; ++u) {
    std::vector<TensorView> v = e_.gather(u);  // stage 3: waits for the (prefetched) all-gather
    {
      Timed t{compute_s_};
      m_.forward_unit(u, params_f32(u, v));
    }
    if (keep_head && u == last)
      head_ = std::move(v);
    else
      e_.release(u);
  }
}

void UnitRunner::backward(float loss_scale) {
  const int last = m_.num_units() - 1;
  for (int u = last; u >= 0; --u) {
    std::vector<TensorView> v = u == last ? head_ : e_.gather(u);
    std::vector<TensorView> g = e_.grads(u);  // zeroed, in the engine's dtype
    {
      Timed t{compute_s_};
      std::vector<const float*> p = params_f32(u, v);
      std::vector<float*> gp;
      if (dt_ == DType::f32) {
        for (const TensorView& t2 : g) gp.push_back(t2.as<float>());
        m_.backward_unit(u, p, gp, loss_scale);
      } else {
        // Compute in f32, then round once into the engine's bf16/f16 buffer.
        float* base = gbuf_.data();
#ifdef ZSDEMO_HAVE_CUDA
        if (gpu_) base = gpu_->gbuf.as<float>();
#endif
        size_t off = 0;
        for (const TensorView& t2 : g) gp.push_back(base + off), off += size_t(t2.numel);
#ifdef ZSDEMO_HAVE_CUDA
        if (gpu_) {
          gpu::fill_zero(gpu_->ctx, base, off * 4);
          m_.backward_unit(u, p, gp, loss_scale);
          for (size_t i = 0; i < g.size(); ++i)
            zeroshard::convert(cuda_view(gp[i], DType::f32, g[i].numel, g[i].device_index), g[i],
                               e_.stream());
        } else
#endif
        {
          std::fill(base, base + off, 0.0f);
          m_.backward_unit(u, p, gp, loss_scale);
          for (size_t i = 0; i < g.size(); ++i) from_f32(gp[i], g[i].data, g[i].dtype, g[i].numel);
        }
      }
    }
    // Starts this unit's reduce-scatter on the communication thread; the loop goes on to the
    // next unit's backward while it runs.
    e_.grads_ready(u);
    e_.release(u);
  }
  head_.clear();
}

float lr_at(int64_t step, int64_t steps, int64_t warmup, float peak) {
  if (warmup > 0 && step <= warmup) return peak * float(step) / float(warmup);
  const double span = double(std::max<int64_t>(1, steps - warmup));
  const double progress = std::min(1.0, double(step - warmup) / span);
  return float(peak * (0.1 + 0.9 * 0.5 * (1.0 + std::cos(M_PI * progress))));
}

std::vector<StepLog> train(Engine& engine, Gpt& model, BatchSampler& data, const TrainSettings& s) {
  UnitRunner run(engine, model);
  const int accum = engine.config().gradient_accumulation_steps;
  std::vector<StepLog> logs;
  double sample_s = 0;
  // Every group follows the schedule from its own peak: group 0's is s.peak_lr, the no-decay
  // group shares it, Muon's AdamW groups have theirs (register_gpt(); not read back from the
  // engine, which after a resume holds the checkpoint's scheduled rate).
  const bool muon = engine.options(0).kind == zeroshard::OptimizerKind::muon;
  std::vector<float> peak;
  for (int g = 0; g < engine.num_groups(); ++g)
    peak.push_back(g == 0 || !muon ? s.peak_lr : kMuonAdamLr);
  for (int64_t step = s.first_step; step <= s.steps; ++step) {
    StepLog log;
    log.step = step;
    log.lr = lr_at(step, s.steps, s.warmup, s.peak_lr);
    for (int g = 0; g < engine.num_groups(); ++g)
      engine.set_lr(g, lr_at(step, s.steps, s.warmup, peak[size_t(g)]));
    const double compute0 = run.compute_s() + sample_s;
    double loss = 0;
    for (int micro = 0; micro < accum; ++micro) {
      {
        Timed t{sample_s};
        Batch b = data.next_train(s.batch);
        model.set_batch(b.inputs, b.targets, s.batch);
      }
      run.forward(/*keep_head=*/true);
      loss += model.loss();
      // The loss scale (f16) multiplies every gradient; step() divides it back out.
      run.backward(engine.loss_scale());
    }
    log.local_loss = loss / accum;
    log.result = engine.step();
    log.compute_s = run.compute_s() + sample_s - compute0;
    if (s.on_step) s.on_step(log);
    logs.push_back(log);
  }
  return logs;
}

double validation_loss(Engine& engine, Gpt& model, const BatchSampler& data, int64_t batch,
                       zeroshard::Communicator& comm) {
  UnitRunner run(engine, model);
  Batch b = data.validation(batch);
  model.set_batch(b.inputs, b.targets, batch);
  run.forward(/*keep_head=*/false);
  double loss[1] = {model.loss()};
  comm.all_reduce(loss, 1, zeroshard::ReduceOp::sum, "validation loss")->wait();
  return loss[0] / comm.size();
}

std::string sample_text(Engine& engine, Gpt& model, const CharTokenizer& tok,
                        const std::string& prompt, int64_t chars, uint64_t seed) {
  UnitRunner run(engine, model);
  const int64_t t = model.shape().seq, v = model.shape().vocab;
  std::vector<int32_t> ctx = tok.encode(prompt);
  std::string out = prompt;
  Rng rng(seed ^ 0x5A3D1E);
  for (int64_t i = 0; i < chars; ++i) {
    // The last t tokens at positions 0.., padded after them: causal attention never looks at
    // the padding from the row we read.
    const int64_t len = std::min<int64_t>(t, int64_t(ctx.size()));
    std::vector<int32_t> in(size_t(t), 0);
    std::copy(ctx.end() - len, ctx.end(), in.begin());
    model.set_batch(in, {}, 1);
    run.forward(/*keep_head=*/false);
    const float* p = model.probs(len - 1);
    // Temperature 0.8: p^(1/0.8), renormalised.
    std::vector<double> w(static_cast<size_t>(v));
    double sum = 0;
    for (int64_t j = 0; j < v; ++j) sum += w[size_t(j)] = std::pow(double(p[j]), 1.25);
    double r = rng.uniform() * sum;
    int32_t next = int32_t(v - 1);
    for (int64_t j = 0; j < v; ++j) {
      r -= w[size_t(j)];
      if (r < 0) {
        next = int32_t(j);
        break;
      }
    }
    ctx.push_back(next);
    out += tok.decode(next);
  }
  return out;
}

}  // namespace zsdemo
