// time_pcie() (zeroshard/calibration.hpp): pinned host memory to and from a GPU, through the
// engine's own device backend, as its staged tiers copy (Compute::copy up, Compute::download
// down).
#include <algorithm>
#include <chrono>
#include <vector>

#include "src/base/check.hpp"
#include "src/base/ledger.hpp"
#include "src/compute/compute.hpp"
#include "zeroshard/calibration.hpp"
#include "zeroshard/config.hpp"

namespace zeroshard {

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
  const Buffer gpu(nullptr, Tier::device, MemKind::buffer, "pcie_device", size_t(bytes),
                   dev->device_memory());
  auto now = [] {
    return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch())
        .count();
  };
  std::vector<double> up, down;
  for (int r = 0; r <= reps; ++r) {  // the first of each untimed
    double t = now();
    dev->copy(gpu.data(), host.data(), size_t(bytes));
    dev->synchronize();
    if (r > 0) up.push_back(now() - t);
    t = now();
    dev->download(host.data(), gpu.data(), size_t(bytes));
    if (r > 0) down.push_back(now() - t);
  }
  auto rate = [bytes](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return double(bytes) / v[v.size() / 2] / 1e9;
  };
  return {rate(up), rate(down)};
}

}  // namespace zeroshard
