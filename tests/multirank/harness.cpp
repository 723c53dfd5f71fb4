#include "tests/multirank/harness.hpp"

#include <unistd.h>

#include <cmath>
#include <cstring>

#include "kernels/cpu/cpu_kernels.hpp"

namespace zs_test {
using namespace zeroshard;

std::filesystem::path process_dir(const std::string& name) {
  static std::vector<std::filesystem::path> made;
  static const struct Sweep {
    ~Sweep() {
      for (const auto& p : made) {
        std::error_code ec;
        std::filesystem::remove(p, ec);  // only an empty directory: anything left stays to see
      }
    }
  } sweep;
  const std::filesystem::path p = std::filesystem::temp_directory_path() /
                                  ("zeroshard-" + name + "-" + std::to_string(::getpid()));
  if (std::filesystem::create_directories(p)) made.push_back(p);
  return p;
}

std::vector<UnitSpec> uneven_model() {
  return {
      {"embed", {{"w", {37, 11}}}},
      {"layer0", {{"w", {11, 23}}, {"b", {23}}}},
      {"layer1", {{"w", {23, 13}}, {"b", {13}}, {"gain", {13}}}},
      {"tiny", {{"b", {1}}}},
      {"head", {{"w", {13, 41}}, {"b", {41}}}},
  };
}

std::vector<float> init_values(const std::string& unit, const std::string& param, int64_t numel) {
  uint64_t h = 1469598103934665603ull;
  for (char c : unit + "/" + param) h = (h ^ uint8_t(c)) * 1099511628211ull;
  std::vector<float> v(static_cast<size_t>(numel));
  for (auto& x : v) {
    h ^= h << 13, h ^= h >> 7, h ^= h << 17;
    x = float(int64_t(h >> 40) - (1 << 23)) / float(1 << 23);
  }
  return v;
}

void register_model(Engine& e, const std::vector<UnitSpec>& model, int bias_group) {
  std::vector<std::vector<float>> keep;  // initial values live until finalize()
  for (const UnitSpec& u : model) {
    std::vector<Param> ps;
    for (const auto& [name, shape] : u.params) {
      keep.push_back(init_values(u.name, name, shape_numel(shape)));
      Param p{name, shape, name[0] == 'b' ? bias_group : 0};
      p.init = {keep.back().data(), int64_t(keep.back().size()), DType::f32};
      ps.push_back(p);
    }
    e.add_unit(u.name, ps);
  }
  e.finalize();
}

float synthetic_grad(float p, int unit, int64_t i, int rank, int micro, int64_t step) {
  float target = 0.5f * std::sin(0.37f * float(i) + 1.3f * float(rank) + 0.7f * float(micro) +
                                 0.11f * float(unit) + 0.05f * float(step));
  return p - target;
}

float load(const void* base, DType dt, int64_t i) {
  switch (dt) {
    case DType::f32:
      return static_cast<const float*>(base)[i];
    case DType::bf16:
      return cpu::bf16_to_float(static_cast<const uint16_t*>(base)[i]);
    case DType::f16:
      return cpu::f16_to_float(static_cast<const uint16_t*>(base)[i]);
  }
  return 0;
}

void store(void* base, DType dt, int64_t i, float v) {
  switch (dt) {
    case DType::f32:
      static_cast<float*>(base)[i] = v;
      break;
    case DType::bf16:
      static_cast<uint16_t*>(base)[i] = cpu::float_to_bf16(v);
      break;
    case DType::f16:
      static_cast<uint16_t*>(base)[i] = cpu::float_to_f16(v);
      break;
  }
}

std::vector<StepResult> train(Engine& e, const TrainOptions& opt) {
  std::vector<StepResult> out;
  const int k = opt.merge_micro ? 1 : opt.micro_batches;
  for (int step = 0; step < opt.steps; ++step) {
    for (int micro = 0; micro < k; ++micro) {
      const float scale = e.loss_scale();
      std::vector<int> units;
      if (opt.order) {
        units = opt.order(e.rank(), step, micro, e.num_units());
      } else {
        for (int u = e.num_units() - 1; u >= 0; --u) units.push_back(u);
      }
      for (int u : units) {
        std::vector<TensorView> p = e.gather(u);
        std::vector<TensorView> g;
        // A GPU engine: parameters come down, gradients are written here and copied over.
        std::vector<std::vector<unsigned char>> host_p, host_g;
        if (opt.download) {
          for (TensorView& v : p) {
            host_p.emplace_back(v.bytes());
            if (v.numel) opt.download(host_p.back().data(), v.data, v.bytes());
            v.data = host_p.back().data();
            host_g.emplace_back(v.bytes());
            g.push_back({host_g.back().data(), v.numel, v.dtype});
          }
        } else {
          g = e.grads(u);
        }
        int64_t flat = 0;
        for (size_t t = 0; t < p.size(); ++t) {
          for (int64_t i = 0; i < p[t].numel; ++i, ++flat) {
            float pv = load(p[t].data, p[t].dtype, i);
            float gv = 0;
            if (opt.merge_micro) {
              for (int j = 0; j < opt.micro_batches; ++j)
                gv += synthetic_grad(pv, u, flat, e.rank(), j, step);
              gv /= float(opt.micro_batches);
            } else {
              gv = synthetic_grad(pv, u, flat, e.rank(), micro, step);
            }
            store(g[t].data, g[t].dtype, i, gv * scale);
          }
        }
        if (opt.tamper) opt.tamper(e, u, micro, step, g);
        if (opt.upload) {
          std::vector<TensorView> dev_g = e.grads(u);
          for (size_t t = 0; t < g.size(); ++t)
            if (g[t].numel) opt.upload(dev_g[t].data, g[t].data, g[t].bytes());
          e.grads_ready(u);
        } else if (opt.download) {
          e.grads_ready(u, g);
        } else {
          e.grads_ready(u);
        }
        e.release(u);
      }
    }
    if (opt.before_step) opt.before_step(e);
    out.push_back(e.step());
  }
  return out;
}

}  // namespace zs_test
