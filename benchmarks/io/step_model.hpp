#pragma once
// Shared by the nvme step benchmarks: the options they share, a model of equal units of one
// parameter each, and the deterministic gradients a backward pass hands over (the same for
// every engine and format).

#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "benchmarks/io/parse_size.hpp"
#include "zeroshard/zeroshard.hpp"

namespace zeroshard::bench {

/// What an nvme step benchmark is told: the swap directory, the model, the rounds, the swapper.
struct StepOptions {
  std::string dir;
  int64_t params = 128000000;
  int units = 16, rounds = 5, qd = 8, buffers = 4, stage = 1;
  int64_t bs = 1 << 20;
};

/// Takes `--key value` into `o` when the key is one of StepOptions'; false otherwise.
inline bool take_step_option(StepOptions& o, const std::string& k, const std::string& v) {
  if (k == "--dir")
    o.dir = v;
  else if (k == "--params")
    o.params = parse_size(v);
  else if (k == "--units")
    o.units = std::atoi(v.c_str());
  else if (k == "--rounds")
    o.rounds = std::atoi(v.c_str());
  else if (k == "--bs")
    o.bs = parse_size(v, true);
  else if (k == "--qd")
    o.qd = std::atoi(v.c_str());
  else if (k == "--buffers")
    o.buffers = std::atoi(v.c_str());
  else if (k == "--stage")
    o.stage = std::atoi(v.c_str());
  else
    return false;
  return true;
}

inline double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

/// `units` units of params / units elements each, then finalize().
inline void build_units(Engine& e, int64_t params, int units) {
  const int64_t per = params / units;
  for (int u = 0; u < units; ++u) e.add_unit("layer" + std::to_string(u), {Param{"w", {per}}});
  e.finalize();
}

/// The backward pass's output, last unit first: gradients that depend on the round.
inline void synthetic_backward(Engine& e, int round) {
  for (int u = e.num_units() - 1; u >= 0; --u) {
    e.gather(u);
    std::vector<TensorView> g = e.grads(u);
    for (TensorView& t : g) {
      if (t.dtype == DType::f32) {
        float* p = t.as<float>();
        for (int64_t i = 0; i < t.numel; ++i)
          p[i] = float((i * 7 + u + round) % 13) * 1e-3f - 6e-3f;
      } else {
        uint16_t* p = t.as<uint16_t>();  // bf16 of small values: the top half of their f32
        for (int64_t i = 0; i < t.numel; ++i) {
          float f = float((i * 7 + u + round) % 13) * 1e-3f - 6e-3f;
          uint32_t b;
          std::memcpy(&b, &f, 4);
          p[i] = uint16_t(b >> 16);
        }
      }
    }
    e.grads_ready(u);
    e.release(u);
  }
}

}  // namespace zeroshard::bench
