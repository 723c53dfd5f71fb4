// time_pcie(), time_update() and time_newton_schulz() (zeroshard/calibration.hpp): a device
// measured through the engine's own backend (src/compute): pinned host memory to and from a GPU
// as its staged tiers copy it (Compute::copy up, Compute::download down), the fused update alone
// as its state tier issues it (Compute::update), and Muon's iteration as its owner runs it.
#include <vector>

#include "base/check.hpp"
#include "base/ledger.hpp"
#include "kernels/cpu/newton_schulz.hpp"
#include "kernels/cpu/quant_code.hpp"
#include "src/compute/compute.hpp"
#include "src/planner/timing.hpp"
#include "zeroshard/calibration.hpp"
#include "zeroshard/config.hpp"

namespace zeroshard {

namespace {

using timing::median;
using timing::now_s;

// Zero-filled memory of the device tier (the GPU's, or the heap on the CPU backend).
Buffer device_buffer(Compute& dev, const char* name, size_t bytes) {
  return Buffer(nullptr, Tier::device, MemKind::buffer, name, bytes, dev.device_memory());
}

}  // namespace

PcieRates time_pcie(int device, int64_t bytes, int reps) {
  if (bytes <= 0 || reps < 1)
    ZS_THROW(invalid_argument, "time_pcie(): " << bytes << " bytes, " << reps << " repetitions");
  Config cfg;
  cfg.device = Device::cuda;
  cfg.device_index = device;
  cpu::Arena arena(1);
  const std::unique_ptr<Compute> dev = make_compute(cfg, arena);  // throws without a GPU
  const Buffer host(nullptr, Tier::host, MemKind::buffer, "pcie_host", size_t(bytes),
                    dev->pinned_memory());
  const Buffer gpu = device_buffer(*dev, "pcie_device", size_t(bytes));
  std::vector<double> up, down;
  for (int r = 0; r <= reps; ++r) {  // the first of each untimed
    double t = now_s();
    dev->copy(gpu.data(), host.data(), size_t(bytes));
    dev->synchronize();
    if (r > 0) up.push_back(now_s() - t);
    t = now_s();
    dev->download(host.data(), gpu.data(), size_t(bytes));
    if (r > 0) down.push_back(now_s() - t);
  }
  return {double(bytes) / median(up) / 1e9, double(bytes) / median(down) / 1e9};
}

double time_update(const Config& cfg, int64_t n, int reps) {
  cfg.validate();
  if (n <= 0 || reps < 1)
    ZS_THROW(invalid_argument, "time_update(): " << n << " parameters, " << reps << " repetitions");
  // Whole q8 blocks (a multiple of the GPU's 8-element accesses too, as shards are).
  n = (n + cfg.state_block - 1) / cfg.state_block * cfg.state_block;
  cpu::Arena arena;  // the engine's default threads
  const std::unique_ptr<Compute> dev = make_compute(cfg, arena);
  const bool q8 = cfg.optimizer_state == StateFormat::q8;
  const DType master_dtype = cfg.bf16_master ? DType::bf16 : DType::f32;
  const size_t un = size_t(n), blocks = q8 ? un / size_t(cfg.state_block) : 0;
  const size_t sbytes = cpu::state_bytes(cfg.optimizer_state);
  // The moments start at zero and the gradient is a nonzero constant (each byte 0x3C: 0.0115 in
  // f32 and bf16, 1.06 in f16), so 8-bit blocks take their full requantization (an all-zero
  // block would skip it).
  const Buffer grad = device_buffer(*dev, "grad", un * dtype_size(cfg.dtype));
  const Buffer out = device_buffer(*dev, "param", un * dtype_size(cfg.dtype));
  const Buffer master = device_buffer(*dev, "master", un * dtype_size(master_dtype));
  const Buffer m = device_buffer(*dev, "state0", un * sbytes);
  const Buffer v = device_buffer(*dev, "state1", un * sbytes);
  const Buffer am = device_buffer(*dev, "state0_absmax", blocks * 4);
  const Buffer av = device_buffer(*dev, "state1_absmax", blocks * 4);
  dev->fill(grad.data(), 0x3C, grad.bytes());
  if (q8) {
    dev->fill(m.data(), cpu::kQ8Zero, un);
    dev->fill(v.data(), cpu::kQ8Zero, un);
  }
  const std::vector<GroupRun> runs{{0, n, 0}};
  cpu::UnitUpdate w;
  w.runs = &runs;
  w.args.master = master.data();
  w.args.master_dtype = master_dtype;
  w.args.state0 = m.data();
  w.args.state1 = v.data();
  w.args.state_format = cfg.optimizer_state;
  w.args.absmax0 = am.as<float>();
  w.args.absmax1 = av.as<float>();
  w.args.block = cfg.state_block;
  w.args.grad = grad.data();
  w.args.grad_dtype = cfg.dtype;
  if (cfg.dtype != DType::f32 || cfg.bf16_master) {  // the low-precision copy, as the engine's
    w.args.out = out.data();
    w.args.out_dtype = cfg.dtype;
  }
  w.args.n = n;
  cpu::UpdateHyper h;  // AdamW after its first step
  h.kind = cfg.optimizer.kind;
  h.lr = cfg.optimizer.lr;
  h.beta1 = cfg.optimizer.beta1;
  h.beta2 = cfg.optimizer.beta2;
  h.eps = cfg.optimizer.eps;
  h.weight_decay = cfg.optimizer.weight_decay;
  h.bias_correction1 = 1 - cfg.optimizer.beta1;
  h.bias_correction2 = 1 - cfg.optimizer.beta2;
  std::vector<double> t;
  dev->synchronize();
  for (int r = 0; r <= reps; ++r) {  // the first untimed: first touch of every page
    const double t0 = now_s();
    dev->update({h}, {w});
    dev->synchronize();
    if (r > 0) t.push_back(now_s() - t0);
  }
  return median(t);
}

double time_newton_schulz(int64_t rows, int64_t cols, int steps, int reps, double* madds) {
  if (rows < 1 || cols < 1 || steps < 1 || reps < 1)
    ZS_THROW(invalid_argument, "time_newton_schulz(): a " << rows << " x " << cols << " matrix, "
                                                          << steps << " steps, " << reps
                                                          << " repetitions");
  std::vector<float> x(size_t(rows * cols)),
      scratch(size_t(cpu::newton_schulz_scratch(rows, cols)));
  for (size_t i = 0; i < x.size(); ++i) x[i] = float(int(i % 97) - 48) * 1e-3f;
  std::vector<double> t;
  for (int r = 0; r <= reps; ++r) {  // the first untimed: pages touched
    const double t0 = now_s();
    cpu::newton_schulz(x.data(), rows, cols, steps, 1e-7f, false, scratch.data());
    if (r > 0) t.push_back(now_s() - t0);
  }
  if (madds) *madds = cpu::newton_schulz_cost(rows, cols, steps);
  return median(t);
}

}  // namespace zeroshard
