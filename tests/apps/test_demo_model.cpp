// The demo GPT's hand-written backward against finite differences of its forward, per
// parameter tensor, on a tiny model. Directional derivatives in f32: for a random direction d,
// (L(p + εd) − L(p − εd)) / 2ε must match ⟨∇L, d⟩ within 1 % + 2e-4. Documented bound: at
// ε = 1e-3 the central difference's own error measured here is below 0.15 % (it shrinks as ε²:
// 7 % at ε = 1e-2, 0.6 % at 3e-3), and f32 rounding of a loss near 2 adds about 1e-4 absolute.
// The derivatives checked are asserted to be non-trivial. Also checks the data path, the flags
// and the learning-rate schedule.
#include <gtest/gtest.h>

#include <cmath>

#include "apps/cli/demo_options.hpp"
#include "apps/data/corpus.hpp"
#include "apps/model/gpt.hpp"
#include "apps/model/ops.hpp"
#include "apps/model/precision.hpp"
#include "apps/train/trainer.hpp"

using namespace zsdemo;

namespace {

struct Params {
  std::vector<std::vector<std::vector<float>>> v;  // unit → param → values
};

double loss_of(Gpt& m, Params& p) {
  for (int u = 0; u < m.num_units(); ++u) {
    std::vector<const float*> ptr;
    for (auto& x : p.v[size_t(u)]) ptr.push_back(x.data());
    m.forward_unit(u, ptr);
  }
  return m.loss();
}

TEST(DemoModel, BackwardMatchesFiniteDifferences) {
  const GptShape s{7, 5, 8, 2, 2};
  const int64_t batch = 3;
  Gpt m(s, batch);
  Params p;
  const auto units = gpt_units(s);
  Rng r(7);
  for (const UnitSpec& u : units) {
    p.v.push_back(gpt_init(s, u, 42));
    // Perturb gains and biases away from 1 / 0 so their gradients are generic.
    for (auto& x : p.v.back())
      for (float& e : x) e += float(0.1 * r.normal());
  }
  std::vector<int32_t> in(size_t(batch * s.seq)), tg(in.size());
  for (size_t i = 0; i < in.size(); ++i)
    in[i] = int32_t(r.below(uint64_t(s.vocab))), tg[i] = int32_t(r.below(uint64_t(s.vocab)));
  m.set_batch(in, tg, batch);

  // Analytic gradients, scaled by a loss scale that the check divides back out.
  const float scale = 4.0f;
  loss_of(m, p);
  Params g = p;
  for (auto& unit : g.v)
    for (auto& x : unit) std::fill(x.begin(), x.end(), 0.0f);
  for (int u = m.num_units() - 1; u >= 0; --u) {
    std::vector<const float*> pp;
    std::vector<float*> gp;
    for (auto& x : p.v[size_t(u)]) pp.push_back(x.data());
    for (auto& x : g.v[size_t(u)]) gp.push_back(x.data());
    m.backward_unit(u, pp, gp, scale);
  }

  const float eps = 1e-3f;
  for (size_t u = 0; u < units.size(); ++u) {
    for (size_t k = 0; k < units[u].params.size(); ++k) {
      SCOPED_TRACE(units[u].name + "/" + units[u].params[k].name);
      std::vector<float>& x = p.v[u][k];
      std::vector<float> d(x.size());
      double analytic = 0;
      for (size_t i = 0; i < x.size(); ++i) {
        d[i] = float(r.normal());
        analytic += double(g.v[u][k][i]) / scale * d[i];
      }
      const std::vector<float> x0 = x;
      for (size_t i = 0; i < x.size(); ++i) x[i] = x0[i] + eps * d[i];
      const double lp = loss_of(m, p);
      for (size_t i = 0; i < x.size(); ++i) x[i] = x0[i] - eps * d[i];
      const double lm = loss_of(m, p);
      x = x0;
      const double numeric = (lp - lm) / (2 * eps);
      EXPECT_GT(std::abs(analytic), 5e-4);  // the check must not pass on zeros
      EXPECT_NEAR(analytic, numeric, 0.01 * std::abs(numeric) + 2e-4);
    }
  }
}

TEST(DemoModel, ParameterCountIsTheGptFormula) {
  const GptShape s{33, 64, 96, 3, 4};
  const int64_t c = s.dim;
  EXPECT_EQ(gpt_param_count(s),
            s.vocab * c + s.seq * c + s.layers * (12 * c * c + 13 * c) + 2 * c + c * s.vocab);
  EXPECT_EQ(int64_t(gpt_units(s).size()), s.layers + 2);
}

// gpt_init draws a large matrix on several threads, each from its place in the parameter's one
// stream: the values must be those of a single sequential pass (the stream's documented seed).
TEST(DemoModel, InitOfALargeMatrixIsItsOneStreamOnAnyThreads) {
  const GptShape s{33, 16, 1024, 1, 8};  // fc.w: 4 Mi elements, drawn by up to 4 threads
  const std::vector<UnitSpec> units = gpt_units(s);
  const UnitSpec& u = units.at(1);
  const auto init = gpt_init(s, u, 42);
  int checked = 0;
  for (size_t k = 0; k < u.params.size(); ++k) {
    const ParamSpec& p = u.params[k];
    if (p.shape.size() != 2 || p.name != "fc.w") continue;
    uint64_t h = 1469598103934665603ull ^ 42;
    for (char ch : u.name + "/" + p.name) h = (h ^ uint8_t(ch)) * 1099511628211ull;
    Rng r(h);
    const std::vector<float>& v = init[k];
    ASSERT_GT(v.size(), size_t(2) << 20);
    for (size_t i = 0; i < v.size(); ++i)
      ASSERT_EQ(v[i], float(0.02 * r.normal())) << "element " << i << " of " << v.size();
    ++checked;
  }
  EXPECT_EQ(checked, 1);
  // discard() skips draws in O(1).
  Rng a(5), b(5);
  for (int i = 0; i < 7; ++i) (void)a.next();
  b.discard(7);
  EXPECT_EQ(a.next(), b.next());
}

TEST(DemoModel, LowPrecisionRoundingIsNearestEven) {
  EXPECT_EQ(f32_to_bf16(1.0f), 0x3F80);
  EXPECT_EQ(bf16_to_f32(f32_to_bf16(1.00390625f)), 1.0f);       // tie: to even (down)
  EXPECT_EQ(bf16_to_f32(f32_to_bf16(1.01171875f)), 1.015625f);  // tie: to even (up)
  EXPECT_EQ(f16_to_f32(f32_to_f16(65504.0f)), 65504.0f);
  EXPECT_TRUE(std::isinf(f16_to_f32(f32_to_f16(65520.0f))));        // rounds up to inf
  EXPECT_EQ(f16_to_f32(f32_to_f16(5.9604645e-8f)), 5.9604645e-8f);  // smallest subnormal
  EXPECT_EQ(f16_to_f32(f32_to_f16(2.9802322e-8f)), 0.0f);           // half of it: tie to even (0)
  for (float v : {0.1f, -3.75f, 1e-3f, 1234.5f})
    EXPECT_NEAR(f16_to_f32(f32_to_f16(v)), v, std::abs(v) * 1e-3);
}

TEST(DemoData, CorpusIsDeterministicAndShardedByRank) {
  const std::string a = generate_corpus(5, 20000), b = generate_corpus(5, 20000);
  EXPECT_EQ(a, b);
  EXPECT_NE(a, generate_corpus(6, 20000));
  EXPECT_NE(a.find("an "), std::string::npos);  // the article rule shows up
  CharTokenizer tok(a);
  EXPECT_LT(tok.vocab_size(), 40);
  EXPECT_EQ(tok.decode(tok.encode("the cat")), "the cat");
  const auto ids = tok.encode(a);
  for (int rank = 0; rank < 2; ++rank) {
    BatchSampler s(ids, rank, 2, 16, 1);
    Batch bt = s.next_train(4);
    ASSERT_EQ(bt.inputs.size(), 64u);
    for (size_t i = 0; i + 1 < bt.inputs.size(); ++i) {
      // Targets are the inputs shifted by one, inside each window of 16.
      if ((i + 1) % 16 != 0) {
        EXPECT_EQ(bt.inputs[i + 1], bt.targets[i]);
      }
    }
  }
  EXPECT_THROW(BatchSampler(std::vector<int32_t>(100, 0), 0, 4, 64, 1), std::invalid_argument);
}

TEST(DemoSchedule, WarmupThenCosineToATenth) {
  EXPECT_FLOAT_EQ(lr_at(1, 100, 10, 1.0f), 0.1f);
  EXPECT_FLOAT_EQ(lr_at(10, 100, 10, 1.0f), 1.0f);
  EXPECT_NEAR(lr_at(100, 100, 10, 1.0f), 0.1f, 1e-6);
  EXPECT_GT(lr_at(50, 100, 10, 1.0f), lr_at(60, 100, 10, 1.0f));
}

TEST(DemoFlags, ErrorsNameTheFlag) {
  DemoOptions o;
  std::string err;
  EXPECT_EQ(parse_demo_options({"--stgae", "3"}, o, err), ParseResult::error);
  EXPECT_NE(err.find("--stage"), std::string::npos) << err;  // the suggestion
  EXPECT_EQ(parse_demo_options({"--stage", "5"}, o, err), ParseResult::error);
  EXPECT_NE(err.find("[0, 3]"), std::string::npos) << err;
  EXPECT_EQ(parse_demo_options({"--dtype", "fp8"}, o, err), ParseResult::error);
  EXPECT_EQ(parse_demo_options({"--dim", "100", "--heads", "3"}, o, err), ParseResult::error);
  EXPECT_EQ(parse_demo_options({"--steps"}, o, err), ParseResult::error);
  // The library's own checks: parameter offload needs stage 3.
  EXPECT_EQ(parse_demo_options({"--stage", "2", "--offload-param", "cpu"}, o, err),
            ParseResult::error);
  EXPECT_NE(err.find("offload_param"), std::string::npos) << err;
  ASSERT_EQ(parse_demo_options(
                {"--stage=1", "--dtype", "f16", "--optimizer", "lion", "--accum", "2"}, o, err),
            ParseResult::run)
      << err;
  EXPECT_EQ(o.config.stage, 1);
  EXPECT_EQ(o.config.dtype, zeroshard::DType::f16);
  EXPECT_EQ(o.config.optimizer.kind, zeroshard::OptimizerKind::lion);
  EXPECT_FLOAT_EQ(o.config.optimizer.lr, 3e-4f);
  EXPECT_EQ(o.config.gradient_accumulation_steps, 2);
  EXPECT_EQ(parse_demo_options({"--help"}, o, err), ParseResult::help);
  // Every flag is documented.
  for (const char* f :
       {"--stage", "--dtype", "--optimizer", "--lr", "--steps", "--batch", "--seq", "--layers",
        "--dim", "--offload-optimizer", "--offload-param", "--nvme-path", "--accum", "--clip",
        "--config", "--seed", "--quiet", "--report-json"})
    EXPECT_NE(demo_help().find(f), std::string::npos) << f;
}

}  // namespace

namespace {

// GELU runs on a fast vectorisable exp; it must stay within f32 rounding noise of libm's tanh.
TEST(DemoOps, GeluMatchesTheTanhFormula) {
  std::vector<float> x, y(4001), dy(4001, 1.0f), dx(4001);
  for (int i = -2000; i <= 2000; ++i) x.push_back(float(i) * 0.01f);
  zsdemo::ops::gelu_forward(x.data(), y.data(), int64_t(x.size()));
  zsdemo::ops::gelu_backward(x.data(), dy.data(), dx.data(), int64_t(x.size()));
  for (size_t i = 0; i < x.size(); ++i) {
    const double v = x[i], k = std::sqrt(2.0 / M_PI), u = k * (v + 0.044715 * v * v * v),
                 t = std::tanh(u);
    EXPECT_NEAR(y[i], 0.5 * v * (1 + t), 2e-6 * (1 + std::abs(v))) << v;
    const double d = 0.5 * (1 + t) + 0.5 * v * (1 - t * t) * k * (1 + 3 * 0.044715 * v * v);
    EXPECT_NEAR(dx[i], d, 2e-6 * (1 + std::abs(v))) << v;
  }
}

}  // namespace
