// GPU benchmark (docs/DESIGN.md rule 9: ratios measured in one run, alternating round by round,
// median of per-round ratios):
//   1. fused AdamW (zeroshard::cuda::optimizer_update) against a device-to-device copy of the
//      same bytes: the update reads master, m, v, grad and writes master, m, v and the copy-out;
//      the reference copies half that many bytes (so it too reads and writes them). A ratio of
//      1.0 means the update runs at copy bandwidth, the ceiling of a memory-bound kernel.
//   2. pinned host↔device copies against pageable ones of the same bytes (what pinning buys).
// Each update case also prints a machine-readable line, `data: {json}` (case key, elements,
// median update and copy milliseconds, median per-round ratio), which run_all.sh joins with
// torch_fused_adamw_bench.py's lines of the same keys to quote zeroshard / torch time.
// Usage: fused_adamw_bench [--elements N] [--rounds R] [--out FILE]

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include "base/cuda_check.hpp"
#include "kernels/cuda/cuda_kernels.hpp"
#include "src/cuda/cuda_resources.hpp"

namespace zs = zeroshard;
namespace zc = zeroshard::cuda;

namespace {

// Deterministic pseudo-random fill in [lo, hi) (a hash of the index), so no host transfer is
// needed to set up gigabytes of state.
__global__ void fill_f32(float* p, int64_t n, uint32_t seed, float lo, float hi) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    uint32_t h = uint32_t(i) * 2654435761u ^ seed;
    h ^= h >> 15;
    h *= 2246822519u;
    h ^= h >> 13;
    p[i] = lo + (hi - lo) * float(h & 0xFFFFFF) / float(1 << 24);
  }
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t m = v.size() / 2;
  return v.size() % 2 ? v[m] : 0.5 * (v[m - 1] + v[m]);
}

struct Options {
  int64_t elements = int64_t{1} << 26;  // 64 Mi parameters: ~1 GiB of optimizer traffic per step
  int rounds = 31;
  std::string out;
};

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::cerr << "missing value after " << a << "\n";
        std::exit(2);
      }
      return argv[++i];
    };
    if (a == "--elements")
      o.elements = std::stoll(next());
    else if (a == "--rounds")
      o.rounds = std::stoi(next());
    else if (a == "--out")
      o.out = next();
    else {
      std::cerr << "usage: fused_adamw_bench [--elements N] [--rounds R] [--out FILE]\n";
      std::exit(2);
    }
  }
  return o;
}

// Milliseconds of `body` on stream s, timed with events.
template <class F>
double time_ms(cudaStream_t s, F&& body) {
  zc::Event a(true), b(true);
  a.record(s);
  body();
  b.record(s);
  b.synchronize();
  return double(b.elapsed_ms_since(a));
}

struct UpdateCase {
  const char* name;
  const char* key;  // the case's name in the data line (torch_fused_adamw_bench.py uses the same)
  zs::DType grad;
  bool has_out;
  zs::DType out;
};

}  // namespace

int main(int argc, char** argv) {
  const Options o = parse(argc, argv);
  std::string why;
  if (zc::device_count(&why) == 0) {
    std::cerr << "fused_adamw_bench: no CUDA GPU on this machine: " << why << "\n";
    return 1;
  }
  try {
    ZS_CUDA_CHECK(cudaSetDevice(0));
    cudaDeviceProp prop{};
    ZS_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
    std::ostringstream report;
    report << "# fused_adamw_bench\n"
           << "device: " << prop.name << " (sm_" << prop.major << prop.minor << ", "
           << prop.multiProcessorCount << " SMs, " << (prop.totalGlobalMem >> 20) << " MiB)\n"
           << "elements: " << o.elements << ", rounds: " << o.rounds
           << " (alternating, order flipped every round; medians of per-round figures)\n\n";

    const int64_t n = o.elements;
    zc::Stream stream(0);
    const cudaStream_t s = stream.get();
    zc::DeviceBuffer master(0, size_t(n) * 4), m(0, size_t(n) * 4), v(0, size_t(n) * 4),
        grad(0, size_t(n) * 4), grad16(0, size_t(n) * 2), out(0, size_t(n) * 4);
    fill_f32<<<1024, 256, 0, s>>>(master.as<float>(), n, 1, -1.0f, 1.0f);
    fill_f32<<<1024, 256, 0, s>>>(m.as<float>(), n, 2, -0.01f, 0.01f);
    fill_f32<<<1024, 256, 0, s>>>(v.as<float>(), n, 3, 0.0f, 1e-4f);
    fill_f32<<<1024, 256, 0, s>>>(grad.as<float>(), n, 4, -1.0f, 1.0f);
    ZS_CUDA_CHECK_LAUNCH("fill_f32");
    zc::convert(grad.data(), zs::DType::f32, grad16.data(), zs::DType::bf16, n, s);

    zeroshard::cpu::UpdateHyper h;
    h.kind = zs::OptimizerKind::adamw;
    h.lr = 1e-4f;
    h.beta1 = 0.9f;
    h.beta2 = 0.999f;
    h.eps = 1e-8f;
    h.weight_decay = 0.01f;
    h.bias_correction1 = 0.1f;
    h.bias_correction2 = 0.001f;
    h.grad_scale = 1.0f / 1024.0f;
    const zc::UpdateRun run{0, n, 0};

    const UpdateCase cases[] = {
        {"AdamW, bf16 grad, bf16 param copy-out", "bf16_grad_bf16_out", zs::DType::bf16, true,
         zs::DType::bf16},
        {"AdamW, f32 grad, no copy-out", "f32_grad_no_out", zs::DType::f32, false, zs::DType::f32}};
    for (const UpdateCase& c : cases) {
      // Bytes the update moves per element: master, m, v read and written, grad read, copy written.
      const size_t gb = zs::dtype_size(c.grad), ob = c.has_out ? zs::dtype_size(c.out) : 0;
      const size_t bytes = size_t(n) * (3 * 4 * 2 + gb + ob);
      // The reference copy reads and writes bytes / 2 each: the same traffic.
      zc::DeviceBuffer src(0, bytes / 2), dst(0, bytes / 2);
      ZS_CUDA_CHECK(cudaMemsetAsync(src.data(), 1, bytes / 2, s));
      zeroshard::cpu::UpdateArgs a;
      a.master = master.as<float>();
      a.state0 = m.as<float>();
      a.state1 = v.as<float>();
      a.grad = c.grad == zs::DType::f32 ? grad.data() : grad16.data();
      a.grad_dtype = c.grad;
      a.out = c.has_out ? out.data() : nullptr;
      a.out_dtype = c.out;
      a.n = n;
      auto update = [&] { zc::optimizer_update(&h, 1, &run, 1, a, s); };
      auto copy = [&] {
        ZS_CUDA_CHECK(
            cudaMemcpyAsync(dst.data(), src.data(), bytes / 2, cudaMemcpyDeviceToDevice, s));
      };
      for (int w = 0; w < 3; ++w) {
        (void)time_ms(s, update);
        (void)time_ms(s, copy);
      }
      std::vector<double> ratio, upd_gbs, copy_gbs, upd_ms, copy_ms;
      for (int r = 0; r < o.rounds; ++r) {
        double tu, tc;
        if (r % 2 == 0) {
          tu = time_ms(s, update);
          tc = time_ms(s, copy);
        } else {
          tc = time_ms(s, copy);
          tu = time_ms(s, update);
        }
        ratio.push_back(tc / tu);
        upd_ms.push_back(tu);
        copy_ms.push_back(tc);
        upd_gbs.push_back(double(bytes) / (tu * 1e6));
        copy_gbs.push_back(double(bytes) / (tc * 1e6));
      }
      char line[512];
      std::snprintf(line, sizeof line,
                    "%s: %.3f of copy bandwidth (median per-round ratio; min %.3f, max %.3f); "
                    "update %.0f GB/s, "
                    "same-bytes D2D copy %.0f GB/s (read + write counted), %.1f bytes/element\n",
                    c.name, median(ratio), *std::min_element(ratio.begin(), ratio.end()),
                    *std::max_element(ratio.begin(), ratio.end()), median(upd_gbs),
                    median(copy_gbs), double(bytes) / double(n));
      report << line;
      // One event pair around one launch each: the times include the host's launch latency, a
      // few microseconds from C++ (torch_fused_adamw_bench.py hides Python's longer one).
      std::snprintf(line, sizeof line,
                    "data: {\"bench\": \"zeroshard\", \"case\": \"%s\", \"elements\": %lld, "
                    "\"bytes_per_element\": %.1f, \"update_ms\": %.6f, \"copy_ms\": %.6f, "
                    "\"copy_over_update\": %.6f, \"rounds\": %d}\n",
                    c.key, static_cast<long long>(n), double(bytes) / double(n), median(upd_ms),
                    median(copy_ms), median(ratio), o.rounds);
      report << line;
    }

    // Host↔device: pinned against pageable, same bytes, alternating.
    const size_t hbytes = size_t(256) << 20;
    zc::PinnedBuffer pinned(hbytes);
    std::vector<char> pageable(hbytes, 1);
    std::memset(pinned.data(), 1, hbytes);
    zc::DeviceBuffer dev(0, hbytes);
    struct Dir {
      const char* name;
      cudaMemcpyKind kind;
    };
    for (const Dir d : {Dir{"host to device", cudaMemcpyHostToDevice},
                        Dir{"device to host", cudaMemcpyDeviceToHost}}) {
      auto copy_from = [&](void* host) {
        return [&, host] {
          if (d.kind == cudaMemcpyHostToDevice)
            ZS_CUDA_CHECK(cudaMemcpyAsync(dev.data(), host, hbytes, d.kind, s));
          else
            ZS_CUDA_CHECK(cudaMemcpyAsync(host, dev.data(), hbytes, d.kind, s));
        };
      };
      auto pin = copy_from(pinned.data());
      auto page = copy_from(pageable.data());
      (void)time_ms(s, pin);
      (void)time_ms(s, page);
      std::vector<double> pin_gbs, page_gbs, ratio;
      for (int r = 0; r < std::max(5, o.rounds / 3); ++r) {
        double tp, tq;
        if (r % 2 == 0) {
          tp = time_ms(s, pin);
          tq = time_ms(s, page);
        } else {
          tq = time_ms(s, page);
          tp = time_ms(s, pin);
        }
        pin_gbs.push_back(double(hbytes) / (tp * 1e6));
        page_gbs.push_back(double(hbytes) / (tq * 1e6));
        ratio.push_back(tq / tp);
      }
      char line[256];
      std::snprintf(
          line, sizeof line,
          "%s, 256 MiB: pinned %.1f GB/s, pageable %.1f GB/s, pinned %.2fx faster (median)\n",
          d.name, median(pin_gbs), median(page_gbs), median(ratio));
      report << line;
    }

    std::cout << report.str();
    if (!o.out.empty()) {
      std::ofstream f(o.out);
      f << report.str();
      if (!f) {
        std::cerr << "fused_adamw_bench: cannot write " << o.out << "\n";
        return 1;
      }
    }
  } catch (const std::exception& e) {
    std::cerr << "fused_adamw_bench: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
