// The demo model on the GPU against the demo model on the CPU: every layer of
// apps/model/ops_cuda.hpp against its apps/model/ops.hpp twin on the same random data, then the
// whole GPT (loss, every parameter gradient, the probabilities) on a tiny shape. Skips without
// a GPU.
//
// How exact, and why:
//  - Matrix products and row reductions: the GPU sums in another order than OpenBLAS and the
//    CPU loops (cuBLAS's tiling, tree reductions), in f32 (cuBLAS in CUBLAS_DEFAULT_MATH: no
//    TF32). A length-k dot product in any order is within about √k·u of exact in practice
//    (u = 2^-24 ≈ 6e-8; the k·u worst case needs every rounding to go the same way), so for
//    k ≤ 256 an output differs from the CPU's by a few 1e-7 of the tensor's magnitude. The
//    check, per tensor: |gpu − cpu| ≤ tol · (|cpu| + max|cpu|), tol = 1e-5 for one layer: an
//    error relative to the tensor's scale, since an element that cancels to near zero carries
//    the absolute error of its terms, not a relative one. expf (GPU) and libm's expf (CPU)
//    differ by ≤ 2 ulp, which the same bound covers.
//  - GELU: the CPU uses a polynomial tanh within 2e-6 · (1 + |x|) of the exact formula
//    (tests/apps/test_demo_model.cpp checks that bound); CUDA's tanhf is within 2 ulp. So
//    |gpu − cpu| ≤ 4e-6 · (1 + |x|) · max(1, |dy|).
//  - Embedding forward and backward, residual adds: bitwise equal (the same f32 additions in
//    the same order; ops_cuda.cu is built with --fmad=false).
//  - Whole model: two blocks deep, forward then backward, so the per-layer differences pass
//    through about 30 layers; tol = 1e-4 per gradient tensor (relative to its scale as above)
//    and 1e-5 relative for the loss (a mean of logs, much better conditioned).
// Every compared tensor is checked to be non-trivial, outputs that are overwritten start as NaN
// on the GPU (an element left unwritten fails), and gradients that accumulate start from the
// same random values on both sides (a kernel that overwrites instead of adding fails).

#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "apps/model/gpt.hpp"
#include "apps/model/ops.hpp"
#include "apps/model/ops_cuda.hpp"
#include "tests/gpu/gpu_test_util.hpp"

namespace {

using zs_gpu_test::DeviceBytes;
namespace ops = zsdemo::ops;
namespace gpu = zsdemo::gpu;

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

std::vector<float> randn(size_t n, uint32_t seed, float mean = 0.0f, float stddev = 1.0f) {
  std::mt19937 g(seed);
  std::normal_distribution<float> d(mean, stddev);
  std::vector<float> v(n);
  for (float& x : v) x = d(g);
  return v;
}

std::vector<int32_t> randint(size_t n, int32_t below, uint32_t seed) {
  std::mt19937 g(seed);
  std::uniform_int_distribution<int32_t> d(0, below - 1);
  std::vector<int32_t> v(n);
  for (int32_t& x : v) x = d(g);
  return v;
}

// max_i |gpu_i − cpu_i| / (|cpu_i| + max|cpu|); NaN (or +inf) if any element is not finite on
// the GPU side or differs in finiteness.
double scaled_error(const std::vector<float>& gpu_v, const std::vector<float>& cpu_v) {
  EXPECT_EQ(gpu_v.size(), cpu_v.size());
  double scale = 0;
  for (float x : cpu_v) scale = std::max(scale, double(std::abs(x)));
  double worst = 0;
  for (size_t i = 0; i < cpu_v.size() && i < gpu_v.size(); ++i) {
    if (!std::isfinite(gpu_v[i])) return std::numeric_limits<double>::quiet_NaN();
    const double e = std::abs(double(gpu_v[i]) - double(cpu_v[i])) /
                     (std::abs(double(cpu_v[i])) + scale + 1e-30);
    worst = std::max(worst, e);
  }
  return worst;
}

double max_abs(const std::vector<float>& v) {
  double m = 0;
  for (float x : v) m = std::max(m, double(std::abs(x)));
  return m;
}

// The GPU result of `dev` against the CPU's `cpu` within tol (see the file comment), and the
// CPU result is not all zeros.
void expect_close(const DeviceBytes& dev, const std::vector<float>& cpu, double tol,
                  const std::string& what) {
  const std::vector<float> g = dev.download<float>();
  EXPECT_GT(max_abs(cpu), 1e-6) << what << ": the reference is trivial";
  const double e = scaled_error(g, cpu);
  EXPECT_LE(e, tol) << what << ": scaled error " << e;
}

void expect_bitwise(const DeviceBytes& dev, const std::vector<float>& cpu,
                    const std::string& what) {
  const std::vector<float> g = dev.download<float>();
  EXPECT_GT(max_abs(cpu), 1e-6) << what << ": the reference is trivial";
  EXPECT_EQ(
      zs_gpu_test::first_mismatch(zeroshard::DType::f32, g.data(), cpu.data(), int64_t(cpu.size())),
      -1)
      << what;
}

// A non-blocking stream of device 0 and a context on it: the ops must not depend on the legacy
// default stream's implicit ordering. Uploads (cudaMemcpy on the legacy stream, which may return
// before the DMA lands) are fenced with ready() before work goes to the context's stream.
// A non-blocking CUDA stream on `device` (this test links only the public library).
class TestStream {
 public:
  explicit TestStream(int device) {
    ZS_CUDA_CHECK(cudaSetDevice(device));
    ZS_CUDA_CHECK(cudaStreamCreateWithFlags(&s_, cudaStreamNonBlocking));
  }
  ~TestStream() { (void)cudaStreamDestroy(s_); }
  TestStream(const TestStream&) = delete;
  TestStream& operator=(const TestStream&) = delete;
  void* handle() const { return static_cast<void*>(s_); }

 private:
  cudaStream_t s_ = nullptr;
};

struct Fixture {
  TestStream stream{0};
  gpu::Context ctx{stream.handle()};
  void ready() { ZS_CUDA_CHECK(cudaDeviceSynchronize()); }
  void done() { ctx.synchronize(); }
};

constexpr double kLayerTol = 1e-5;
constexpr double kModelTol = 1e-4;

TEST(GpuDemoOps, Linear) {
  ZS_REQUIRE_GPU();
  Fixture f;
  const int64_t n = 37, in = 48, out = 80;
  const auto x = randn(size_t(n * in), 1), w = randn(size_t(in * out), 2, 0.0f, 0.2f),
             b = randn(size_t(out), 3), dy = randn(size_t(n * out), 4);
  const auto dw0 = randn(size_t(in * out), 5), db0 = randn(size_t(out), 6);
  for (bool bias : {true, false}) {
    SCOPED_TRACE(bias ? "with bias" : "without bias");
    std::vector<float> y(size_t(n * out)), dx(size_t(n * in)), dw = dw0, db = db0;
    ops::linear_forward(x.data(), w.data(), bias ? b.data() : nullptr, y.data(), n, in, out);
    ops::linear_backward(x.data(), w.data(), dy.data(), dx.data(), dw.data(),
                         bias ? db.data() : nullptr, n, in, out);
    DeviceBytes gx(x), gw(w), gb(b), gdy(dy), gy(std::vector<float>(y.size(), kNaN)),
        gdx(std::vector<float>(dx.size(), kNaN)), gdw(dw0), gdb(db0);
    f.ready();
    gpu::linear_forward(f.ctx, gx.as<float>(), gw.as<float>(), bias ? gb.as<float>() : nullptr,
                        gy.as<float>(), n, in, out);
    gpu::linear_backward(f.ctx, gx.as<float>(), gw.as<float>(), gdy.as<float>(), gdx.as<float>(),
                         gdw.as<float>(), bias ? gdb.as<float>() : nullptr, n, in, out);
    f.done();
    expect_close(gy, y, kLayerTol, "y");
    expect_close(gdx, dx, kLayerTol, "dx");
    expect_close(gdw, dw, kLayerTol, "dw (accumulated)");
    expect_close(gdb, db, kLayerTol, "db (accumulated, or untouched without bias)");
  }
  // dx = null: only the parameter gradients.
  std::vector<float> dw = dw0;
  ops::linear_backward(x.data(), w.data(), dy.data(), nullptr, dw.data(), nullptr, n, in, out);
  DeviceBytes gx(x), gw(w), gdy(dy), gdw(dw0);
  f.ready();
  gpu::linear_backward(f.ctx, gx.as<float>(), gw.as<float>(), gdy.as<float>(), nullptr,
                       gdw.as<float>(), nullptr, n, in, out);
  f.done();
  expect_close(gdw, dw, kLayerTol, "dw without dx");
}

TEST(GpuDemoOps, LayerNorm) {
  ZS_REQUIRE_GPU();
  Fixture f;
  // c > the kernel's 128 threads per row; rows with a large mean test the two-pass variance.
  for (int64_t c : {24, 200}) {
    SCOPED_TRACE("c = " + std::to_string(c));
    const int64_t n = 37;
    const auto x = randn(size_t(n * c), 11, 3.0f, 2.0f), g = randn(size_t(c), 12, 1.0f, 0.3f),
               b = randn(size_t(c), 13), dy = randn(size_t(n * c), 14);
    const auto dx0 = randn(size_t(n * c), 15), dg0 = randn(size_t(c), 16),
               db0 = randn(size_t(c), 17);
    std::vector<float> y(size_t(n * c)), mean(static_cast<size_t>(n)), rstd(static_cast<size_t>(n)),
        dx = dx0, dg = dg0, db = db0;
    ops::layernorm_forward(x.data(), g.data(), b.data(), y.data(), mean.data(), rstd.data(), n, c);
    ops::layernorm_backward(x.data(), g.data(), mean.data(), rstd.data(), dy.data(), dx.data(),
                            dg.data(), db.data(), n, c);
    DeviceBytes gx(x), gg(g), gb(b), gdy(dy), gy(std::vector<float>(y.size(), kNaN)),
        gmean(std::vector<float>(mean.size(), kNaN)), grstd(std::vector<float>(rstd.size(), kNaN)),
        gdx(dx0), gdg(dg0), gdb(db0);
    f.ready();
    gpu::layernorm_forward(f.ctx, gx.as<float>(), gg.as<float>(), gb.as<float>(), gy.as<float>(),
                           gmean.as<float>(), grstd.as<float>(), n, c);
    gpu::layernorm_backward(f.ctx, gx.as<float>(), gg.as<float>(), gmean.as<float>(),
                            grstd.as<float>(), gdy.as<float>(), gdx.as<float>(), gdg.as<float>(),
                            gdb.as<float>(), n, c);
    f.done();
    expect_close(gy, y, kLayerTol, "y");
    expect_close(gmean, mean, kLayerTol, "mean");
    expect_close(grstd, rstd, kLayerTol, "rstd");
    expect_close(gdx, dx, kLayerTol, "dx (accumulated)");
    expect_close(gdg, dg, kLayerTol, "dg (accumulated)");
    expect_close(gdb, db, kLayerTol, "db (accumulated)");
  }
}

TEST(GpuDemoOps, Gelu) {
  ZS_REQUIRE_GPU();
  Fixture f;
  const int64_t n = 5001;
  const auto x = randn(size_t(n), 21, 0.0f, 3.0f), dy = randn(size_t(n), 22);
  std::vector<float> y(static_cast<size_t>(n)), dx(static_cast<size_t>(n));
  ops::gelu_forward(x.data(), y.data(), n);
  ops::gelu_backward(x.data(), dy.data(), dx.data(), n);
  DeviceBytes gx(x), gdy(dy), gy(std::vector<float>(y.size(), kNaN)),
      gdx(std::vector<float>(dx.size(), kNaN));
  f.ready();
  gpu::gelu_forward(f.ctx, gx.as<float>(), gy.as<float>(), n);
  gpu::gelu_backward(f.ctx, gx.as<float>(), gdy.as<float>(), gdx.as<float>(), n);
  f.done();
  const auto hy = gy.download<float>(), hdx = gdx.download<float>();
  for (size_t i = 0; i < size_t(n); ++i) {
    const double bound = 4e-6 * (1 + std::abs(x[i]));
    ASSERT_NEAR(hy[i], y[i], bound) << "y at x = " << x[i];
    ASSERT_NEAR(hdx[i], dx[i], bound * std::max(1.0f, std::abs(dy[i]))) << "dx at x = " << x[i];
  }
}

TEST(GpuDemoOps, Attention) {
  ZS_REQUIRE_GPU();
  Fixture f;
  struct Case {
    int64_t batch, t, c, heads;
  };
  // A small one, and one whose rows are longer than the 128 threads of the row kernels.
  for (const Case k : {Case{2, 19, 24, 3}, Case{1, 150, 16, 2}}) {
    SCOPED_TRACE("B=" + std::to_string(k.batch) + " T=" + std::to_string(k.t));
    const int64_t n = k.batch * k.t, pt = k.batch * k.heads * k.t * k.t;
    const auto qkv = randn(size_t(n * 3 * k.c), 31), dy = randn(size_t(n * k.c), 32);
    std::vector<float> y(size_t(n * k.c)), probs(static_cast<size_t>(pt)), dqkv(qkv.size()),
        scratch(size_t(k.t * k.t));
    ops::attention_forward(qkv.data(), y.data(), probs.data(), k.batch, k.t, k.c, k.heads);
    ops::attention_backward(qkv.data(), probs.data(), dy.data(), dqkv.data(), scratch.data(),
                            k.batch, k.t, k.c, k.heads);
    DeviceBytes gqkv(qkv), gdy(dy), gy(std::vector<float>(y.size(), kNaN)),
        gprobs(std::vector<float>(probs.size(), kNaN)),
        gdqkv(std::vector<float>(dqkv.size(), kNaN)), gscratch(size_t(pt) * sizeof(float));
    f.ready();
    gpu::attention_forward(f.ctx, gqkv.as<float>(), gy.as<float>(), gprobs.as<float>(), k.batch,
                           k.t, k.c, k.heads);
    gpu::attention_backward(f.ctx, gqkv.as<float>(), gprobs.as<float>(), gdy.as<float>(),
                            gdqkv.as<float>(), gscratch.as<float>(), k.batch, k.t, k.c, k.heads);
    f.done();
    expect_close(gy, y, kLayerTol, "y");
    expect_close(gprobs, probs, kLayerTol, "probs");
    expect_close(gdqkv, dqkv, kLayerTol, "dqkv");
    // The mask: exact zeros above the diagonal.
    const auto hp = gprobs.download<float>();
    for (int64_t blk = 0; blk < k.batch * k.heads; ++blk)
      for (int64_t i = 0; i < k.t; ++i)
        for (int64_t j = i + 1; j < k.t; ++j)
          ASSERT_EQ(hp[size_t((blk * k.t + i) * k.t + j)], 0.0f);
  }
}

TEST(GpuDemoOps, SoftmaxCrossEntropy) {
  ZS_REQUIRE_GPU();
  Fixture f;
  // v > the 128 threads per row; logits wide enough that some probabilities are tiny.
  const int64_t n = 37, v = 300;
  const auto logits = randn(size_t(n * v), 41, 0.0f, 4.0f);
  const auto targets = randint(size_t(n), int32_t(v), 42);
  std::vector<float> p = logits;
  const double loss = ops::softmax_cross_entropy(p.data(), targets.data(), n, v);
  std::vector<float> dl = p;
  ops::softmax_cross_entropy_backward(dl.data(), targets.data(), n, v, 3.0f);

  DeviceBytes gl(logits), gt(targets), gloss(sizeof(double));
  f.ready();
  const double gpu_loss = gpu::softmax_cross_entropy(f.ctx, gl.as<float>(), gt.as<int32_t>(), n, v);
  EXPECT_NEAR(gpu_loss, loss, 1e-5 * std::abs(loss));
  EXPECT_GT(loss, 0.1);
  expect_close(gl, p, kLayerTol, "softmax");
  gpu::softmax_cross_entropy_backward(f.ctx, gl.as<float>(), gt.as<int32_t>(), n, v, 3.0f);
  f.done();
  expect_close(gl, dl, kLayerTol, "dlogits");

  // The asynchronous variant writes the same loss to device memory.
  DeviceBytes gl2(logits);
  f.ready();
  gpu::softmax_cross_entropy_async(f.ctx, gl2.as<float>(), gt.as<int32_t>(), n, v,
                                   gloss.as<double>());
  f.done();
  EXPECT_EQ(gloss.download<double>()[0], gpu_loss);  // same kernels, same order: same bits
}

TEST(GpuDemoOps, EmbeddingAndResidualAreBitwise) {
  ZS_REQUIRE_GPU();
  Fixture f;
  const int64_t vocab = 9, t = 7, batch = 5, c = 300, n = batch * t;
  const auto wte = randn(size_t(vocab * c), 51), wpe = randn(size_t(t * c), 52),
             dx = randn(size_t(n * c), 53), dwte0 = randn(size_t(vocab * c), 54),
             dwpe0 = randn(size_t(t * c), 55);
  auto tokens = randint(size_t(n), int32_t(vocab - 1), 56);  // token vocab−1 never appears
  // The CPU loops of gpt.cpp.
  std::vector<float> x(size_t(n * c)), dwte = dwte0, dwpe = dwpe0;
  for (int64_t i = 0; i < n; ++i)
    for (int64_t j = 0; j < c; ++j)
      x[size_t(i * c + j)] = wte[size_t(tokens[size_t(i)] * c + j)] + wpe[size_t((i % t) * c + j)];
  for (int64_t i = 0; i < n; ++i)
    for (int64_t j = 0; j < c; ++j) {
      dwte[size_t(tokens[size_t(i)] * c + j)] += dx[size_t(i * c + j)];
      dwpe[size_t((i % t) * c + j)] += dx[size_t(i * c + j)];
    }
  // Rows grouped by token (what Gpt::set_batch builds).
  std::vector<int32_t> offsets(size_t(vocab) + 1, 0), rows;
  for (int32_t id : tokens) ++offsets[size_t(id) + 1];
  for (size_t v = 1; v < offsets.size(); ++v) offsets[v] += offsets[v - 1];
  for (int32_t v = 0; v < vocab; ++v)
    for (int64_t i = 0; i < n; ++i)
      if (tokens[size_t(i)] == v) rows.push_back(int32_t(i));
  std::vector<float> sum = x;
  ops::add_inplace(sum.data(), dx.data(), n * c);

  DeviceBytes gtok(tokens), gwte(wte), gwpe(wpe), gdx(dx), gdwte(dwte0), gdwpe(dwpe0),
      goff(offsets), grows(rows), gx(std::vector<float>(x.size(), kNaN));
  f.ready();
  gpu::embedding_forward(f.ctx, gtok.as<int32_t>(), gwte.as<float>(), gwpe.as<float>(),
                         gx.as<float>(), n, t, c);
  gpu::embedding_backward(f.ctx, goff.as<int32_t>(), grows.as<int32_t>(), gdx.as<float>(),
                          gdwte.as<float>(), gdwpe.as<float>(), n, t, c, vocab);
  f.done();
  expect_bitwise(gx, x, "embedding forward");
  expect_bitwise(gdwte, dwte, "wte gradient (the unused token's row keeps its value)");
  expect_bitwise(gdwpe, dwpe, "wpe gradient");
  gpu::add_inplace(f.ctx, gx.as<float>(), gdx.as<float>(), n * c);
  f.done();
  expect_bitwise(gx, sum, "residual add");
}

// The whole model: a CPU Gpt and a GPU Gpt on the same parameters and batches.
TEST(GpuDemoModel, ForwardBackwardMatchesTheCpuModel) {
  ZS_REQUIRE_GPU();
  using namespace zsdemo;
  const GptShape s{11, 16, 32, 2, 4};
  const int64_t max_batch = 3;
  TestStream stream(0);
  Gpt cpu_model(s, max_batch);
  Gpt gpu_model(s, max_batch, zeroshard::Device::cuda, stream.handle());
  EXPECT_EQ(gpu_model.device(), zeroshard::Device::cuda);
  EXPECT_EQ(gpu_model.stream(), stream.handle());

  // Parameters as in the CPU gradient check: GPT-2 init, gains and biases perturbed.
  const std::vector<UnitSpec> units = gpt_units(s);
  std::vector<std::vector<std::vector<float>>> params;
  std::vector<std::vector<DeviceBytes>> dparams;
  std::mt19937 g(61);
  std::normal_distribution<float> nd(0.0f, 0.1f);
  for (const UnitSpec& u : units) {
    params.push_back(gpt_init(s, u, 42));
    dparams.emplace_back();
    for (auto& x : params.back()) {
      for (float& e : x) e += nd(g);
      dparams.back().emplace_back(x);
    }
  }
  ZS_CUDA_CHECK(cudaDeviceSynchronize());  // the uploads have landed

  for (int64_t batch : {max_batch, max_batch - 1}) {
    SCOPED_TRACE("batch " + std::to_string(batch));
    const auto in = randint(size_t(batch * s.seq), int32_t(s.vocab), uint32_t(70 + batch));
    const auto tg = randint(in.size(), int32_t(s.vocab), uint32_t(80 + batch));
    cpu_model.set_batch(in, tg, batch);
    gpu_model.set_batch(in, tg, batch);
    for (int u = 0; u < cpu_model.num_units(); ++u) {
      std::vector<const float*> hp, dp;
      for (auto& x : params[size_t(u)]) hp.push_back(x.data());
      for (auto& d : dparams[size_t(u)]) dp.push_back(d.as<const float>());
      cpu_model.forward_unit(u, hp);
      gpu_model.forward_unit(u, dp);
    }
    // Backward before reading the loss: the GPU model keeps it on the device until asked.
    const float scale = 4.0f;
    std::vector<std::vector<std::vector<float>>> grads;
    std::vector<std::vector<DeviceBytes>> dgrads;
    for (const auto& unit : params) {
      grads.emplace_back();
      dgrads.emplace_back();
      for (const auto& x : unit) {
        grads.back().emplace_back(x.size(), 0.0f);
        dgrads.back().emplace_back(std::vector<float>(x.size(), 0.0f));
      }
    }
    ZS_CUDA_CHECK(cudaDeviceSynchronize());
    for (int u = cpu_model.num_units() - 1; u >= 0; --u) {
      std::vector<const float*> hp, dp;
      std::vector<float*> hg, dg;
      for (auto& x : params[size_t(u)]) hp.push_back(x.data());
      for (auto& d : dparams[size_t(u)]) dp.push_back(d.as<const float>());
      for (auto& x : grads[size_t(u)]) hg.push_back(x.data());
      for (auto& d : dgrads[size_t(u)]) dg.push_back(d.as<float>());
      cpu_model.backward_unit(u, hp, hg, scale);
      gpu_model.backward_unit(u, dp, dg, scale);
    }
    const double cpu_loss = cpu_model.loss(), gpu_loss = gpu_model.loss();
    EXPECT_GT(cpu_loss, 1.0);
    EXPECT_NEAR(gpu_loss, cpu_loss, 1e-5 * cpu_loss);
    gpu_model.synchronize();
    for (size_t u = 0; u < units.size(); ++u)
      for (size_t k = 0; k < units[u].params.size(); ++k)
        expect_close(dgrads[u][k], grads[u][k], kModelTol,
                     "gradient of " + units[u].name + "/" + units[u].params[k].name);
    // The softmax of the training forward became dlogits in backward; probs() is checked on an
    // inference forward below.
  }

  // Inference (no targets): probs() returns host memory on both.
  const int64_t batch = 2;
  const auto in = randint(size_t(batch * s.seq), int32_t(s.vocab), 91);
  cpu_model.set_batch(in, {}, batch);
  gpu_model.set_batch(in, {}, batch);
  for (int u = 0; u < cpu_model.num_units(); ++u) {
    std::vector<const float*> hp, dp;
    for (auto& x : params[size_t(u)]) hp.push_back(x.data());
    for (auto& d : dparams[size_t(u)]) dp.push_back(d.as<const float>());
    cpu_model.forward_unit(u, hp);
    gpu_model.forward_unit(u, dp);
  }
  for (int64_t row : {int64_t{0}, s.seq - 1, batch * s.seq - 1}) {
    const float* cp = cpu_model.probs(row);
    const std::vector<float> c(cp, cp + s.vocab);
    const float* gp = gpu_model.probs(row);
    const std::vector<float> gv(gp, gp + s.vocab);
    EXPECT_LE(scaled_error(gv, c), kModelTol) << "probs of row " << row;
    double sum = 0;
    for (float p : gv) sum += p;
    EXPECT_NEAR(sum, 1.0, 1e-5);
  }
}

}  // namespace
