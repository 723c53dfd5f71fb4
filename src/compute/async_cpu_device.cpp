// The asynchronous CPU device: a StreamDevice whose streams are threads, a testing device that
// runs the GPU backend's ordering (stream_compute.cpp, the very code CUDA runs) on machines
// without a GPU. Each stream does its work in issue order on its own thread; copies read and
// write memory when the stream reaches them, not when they are issued. Before each piece of
// work the stream sleeps a random 0..jitter_us microseconds (seeded), so work that is waited
// for too late shows as a wrong result or a crash instead of passing by luck.
//
// Its device and pinned memory is host memory whose freeing waits for every stream, as
// cudaFree does, and its TensorViews say Device::cpu; but the engine treats it as a GPU
// (Compute::streams()): staged tiers, copies up and down, waits, and device buffers staged
// through pinned memory for a host communicator (staged_communicator.hpp, the code CUDA runs). Its
// kernels are the CPU backend's (cpu_work.hpp), run on the engine's arena from the stream thread,
// so its results are bitwise the synchronous CPU backend's.

#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "base/check.hpp"
#include "src/compute/async_device_communicator.hpp"
#include "src/compute/compute.hpp"
#include "src/compute/cpu_stream.hpp"
#include "src/compute/cpu_work.hpp"
#include "src/compute/device_communicator.hpp"
#include "src/compute/staged_communicator.hpp"
#include "src/compute/stream_device.hpp"

namespace zeroshard {
namespace {

class AsyncCpuDevice;

// Every asynchronous CPU device of the process plays the same GPU: each one's memory is device
// memory to every communicator (engines may share one, as they share NCCL's), and a free waits
// for the streams of them all, of their communicators and of the trainers, as cudaFree waits
// for the device.
struct Gpu {
  std::mutex mu;
  std::vector<AsyncCpuDevice*> devices;                // guarded by mu, as are the lists below
  std::vector<std::weak_ptr<CpuStream>> comm_streams;  // of the communicators they made
  std::vector<CpuStream*> trainer_streams;  // AsyncTrainerStream's: set_stream() takes only these
};
Gpu& gpu() {
  static Gpu g;
  return g;
}
bool is_trainer_stream(const void* s) {
  std::lock_guard<std::mutex> lock(gpu().mu);
  const auto& live = gpu().trainer_streams;
  return std::find(live.begin(), live.end(), s) != live.end();
}

// Host memory whose freeing first waits for the work queued on every stream, as cudaFree
// does: Buffers the engine drops while a stream still reads them are not freed under it.
// Zero-filled, 256-byte aligned; large blocks are anonymous mappings, as Buffer's own are.
class WaitingHeap final : public Allocator {
 public:
  explicit WaitingHeap(std::function<void()> wait_all) : wait_all_(std::move(wait_all)) {}
  void* allocate(size_t bytes, const std::string& name) override {
    void* p = nullptr;
    if (bytes >= kMapped) {
      p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
      if (p == MAP_FAILED) p = nullptr;
    } else {
      p = std::aligned_alloc(256, (bytes + 255) / 256 * 256);
      if (p) std::memset(p, 0, bytes);
    }
    if (!p)
      ZS_THROW(no_space,
               "asynchronous CPU device: cannot allocate " << bytes << " bytes for " << name);
    std::lock_guard<std::mutex> lock(mu_);
    sizes_[static_cast<char*>(p)] = bytes;
    return p;
  }
  /// Whether `p` points into a block of this heap.
  bool contains(const void* p) const {
    const char* c = static_cast<const char*>(p);
    std::lock_guard<std::mutex> lock(mu_);
    auto it = sizes_.upper_bound(const_cast<char*>(c));
    if (it == sizes_.begin()) return false;
    --it;
    return c < it->first + it->second;
  }
  void deallocate(void* p) noexcept override {
    wait_all_();
    size_t bytes = 0;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = sizes_.find(static_cast<char*>(p));
      if (it == sizes_.end()) return;
      bytes = it->second;
      sizes_.erase(it);
    }
    if (bytes >= kMapped)
      ::munmap(p, bytes);
    else
      std::free(p);
  }

 private:
  static constexpr size_t kMapped = size_t(1) << 20;
  std::function<void()> wait_all_;
  mutable std::mutex mu_;
  std::map<char*, size_t> sizes_;  // ordered: contains() finds the block below a pointer
};

// Host memory for the staging allocator (no streams: the staged communicator orders its uses).
class HostBlocks final : public CachingAllocator::Backend {
 public:
  void* alloc(size_t bytes) override { return std::aligned_alloc(256, (bytes + 255) / 256 * 256); }
  void free(void* p) noexcept override { std::free(p); }
  void* new_event() noexcept override { return nullptr; }
  void delete_event(void*) noexcept override {}
  bool record(void*, void*) noexcept override { return false; }
  bool done(void*) override { return true; }
  void wait(void*) noexcept override {}
};

// Device buffers through a host communicator, as on a GPU: the device heap's blocks are staged,
// and the copies are plain memcpys on the calling thread that wait for no stream (cudaMemcpy
// does not wait for the engine's non-blocking streams either), so a collective started before
// the work that fills its buffer reads the wrong bytes here too.
class AsyncStaging final : public StagingDevice {
 public:
  explicit AsyncStaging(std::shared_ptr<const WaitingHeap> device_heap)
      : heap_(std::move(device_heap)) {}
  int device_of(const void* p) override { return p && heap_->contains(p) ? 0 : -1; }
  void to_host(void* host, const void* dev, size_t bytes, int) override {
    std::memcpy(host, dev, bytes);
  }
  void to_device(void* dev, const void* host, size_t bytes, int) override {
    std::memcpy(dev, host, bytes);
  }
  std::shared_ptr<CachingAllocator> pinned_allocator(int device) override {
    return CachingAllocator::create(CachingAllocator::Kind::pinned_host, device,
                                    std::make_unique<HostBlocks>());
  }

 private:
  std::shared_ptr<const WaitingHeap> heap_;
};

class AsyncCpuDevice final : public StreamDevice {
 public:
  AsyncCpuDevice(cpu::Arena& arena, uint64_t seed, int jitter_us, AsyncComm comm)
      : arena_(arena),
        seed_(seed),
        jitter_us_(jitter_us),
        comm_(comm),
        heap_(std::make_shared<WaitingHeap>([] { wait_all(); })),
        pinned_([] { wait_all(); }) {
    ZS_CHECK(jitter_us >= 0);
    std::lock_guard<std::mutex> lock(gpu().mu);
    gpu().devices.push_back(this);
  }
  ~AsyncCpuDevice() override {
    {
      std::lock_guard<std::mutex> lock(gpu().mu);
      auto& d = gpu().devices;
      d.erase(std::find(d.begin(), d.end(), this));
    }
    // The device goes after every buffer it worked on (Resources), and each free waited for the
    // streams: work still queued now was issued after the last free and may touch memory freed
    // since, which on a GPU is a silent corruption or a fault much later. A testing device says
    // so loudly.
    for (auto& s : streams_) {
      if (s->pending() > 0) {
        std::fprintf(stderr,
                     "zeroshard: the asynchronous CPU device was destroyed with %llu piece(s) of "
                     "work in flight on a stream: its owner freed memory the stream still uses "
                     "(a missing synchronize() before teardown)\n",
                     static_cast<unsigned long long>(s->pending()));
        std::abort();
      }
    }
  }

  Device device() const override { return Device::cpu; }
  int device_index() const override { return 0; }
  Allocator* device_memory() override { return heap_.get(); }
  Allocator* pinned_memory() override { return &pinned_; }
  // Its memory needs no registration; the handle's end waits for every stream, as the end of
  // a CUDA registration must (a copy queued from that memory may still run).
  std::shared_ptr<void> register_host(void* p, size_t) override {
    return std::shared_ptr<void>(p, [](void*) { wait_all(); });
  }
  // A host communicator could read its device memory as it is, but a GPU's cannot: the device
  // buffers go through pinned staging, as on CUDA with MPI, or the collectives are ordered on the
  // device, as on CUDA with NCCL (AsyncComm). The engine drops its communicators after the
  // device: the staged ones keep the heap's block list, which they classify pointers by.
  std::shared_ptr<Communicator> carry(std::shared_ptr<Communicator> comm) override {
    if (comm_ == AsyncComm::staged)
      return stage_through(std::move(comm), std::make_shared<AsyncStaging>(heap_));
    AsyncCommHooks hooks;
    hooks.is_device = [](const void* p) {
      std::lock_guard<std::mutex> lock(gpu().mu);
      for (const AsyncCpuDevice* d : gpu().devices)
        if (p && d->heap_->contains(p)) return true;
      return false;
    };
    hooks.enroll = [](const std::shared_ptr<CpuStream>& s) {
      std::lock_guard<std::mutex> lock(gpu().mu);
      gpu().comm_streams.push_back(s);
    };
    return order_like_nccl(std::move(comm), std::move(hooks), seed_ + 104729, jitter_us_);
  }

  // NCCL's ordering played by a communicator of an asynchronous CPU device (device() −1).
  bool takes(const DeviceCommunicator& c) const override { return c.device() == -1; }

  Stream create_stream() override {
    std::lock_guard<std::mutex> lock(mu_);
    streams_.push_back(std::make_unique<CpuStream>(seed_ + streams_.size(), jitter_us_));
    return streams_.back().get();
  }
  void sync_stream(Stream s) override { cs(s)->synchronize(); }
  // A trainer's stream (AsyncTrainerStream, the tests' stand-in for torch's CUDA stream); the
  // device's own streams have no handle a trainer could queue on, so the host trainer waits.
  Stream adopt_stream(void* trainer_stream) override {
    if (!is_trainer_stream(trainer_stream))
      ZS_THROW(invalid_argument,
               "set_stream(): the engine runs on the CPU (the asynchronous CPU device, "
               "zeroshard.async_device); streams belong to the cuda device (the tests' "
               "AsyncTrainerStream aside)");
    return trainer_stream;
  }
  void* public_handle(Stream s) const override { return is_trainer_stream(s) ? s : nullptr; }

  void fill(void* p, unsigned char value, size_t bytes, Stream s) override {
    cs(s)->issue([=] { std::memset(p, value, bytes); });
  }
  void copy(void* dst, const void* src, size_t bytes, Stream s) override {
    cs(s)->issue([=] { std::memcpy(dst, src, bytes); });
  }
  void convert(const void* src, DType sd, void* dst, DType dd, int64_t n, Stream s) override {
    cs(s)->issue([=, this] { cpu_work::convert(arena_, src, sd, dst, dd, n); });
  }
  void accumulate(float* acc, const void* g, DType gd, int64_t n, Stream s) override {
    cs(s)->issue([=, this] { cpu_work::accumulate(arena_, acc, g, gd, n); });
  }
  void update(const std::vector<cpu::UpdateHyper>& hyper, const cpu::UnitUpdate& unit,
              Stream s) override {
    // The hyperparameters and runs as they are now (a GPU launch copies them into its
    // arguments).
    cs(s)->issue([this, hyper, u = unit, runs = *unit.runs]() mutable {
      u.runs = &runs;
      cpu_work::update(arena_, hyper, {u});
    });
  }
  void muon_average(const cpu::UpdateArgs& a, const cpu::UpdateHyper& h, int64_t lo, int64_t hi,
                    float* d, Stream s) override {
    cs(s)->issue([=, this] { cpu_work::muon_average(arena_, a, h, lo, hi, d, wide_); });
  }
  void newton_schulz(float* x, int64_t rows, int64_t cols, const cpu::NsOptions& o, float* scratch,
                     Stream s) override {
    cs(s)->issue([=] { cpu_work::newton_schulz(x, rows, cols, o, scratch); });
  }
  void sum_squares(const GradSpan& x, double* out, bool accumulate, Stream s) override {
    cs(s)->issue([=, this] {
      const double v = cpu_work::sum_squares(arena_, x);
      // Summed in the synchronous backend's order: span after span from 0.
      out[0] = accumulate ? out[0] + v : v;
      out[1] = (accumulate && out[1] != 0.0) || !std::isfinite(out[0]) ? 1.0 : 0.0;
    });
  }
  double* device_sums() override { return device_sums_; }
  double* host_sums() override { return host_sums_; }

 private:
  static CpuStream* cs(Stream s) { return static_cast<CpuStream*>(s); }
  // Every stream's queued work done, every device's and the trainers' streams too, as cudaFree
  // waits for the whole device (failures stay for each stream's next synchronisation).
  static void wait_all() noexcept {
    std::vector<std::shared_ptr<CpuStream>> comms;
    {
      std::lock_guard<std::mutex> lock(gpu().mu);
      for (AsyncCpuDevice* d : gpu().devices) {
        std::lock_guard<std::mutex> own(d->mu_);
        for (auto& s : d->streams_) s->drain();
      }
      auto& cs = gpu().comm_streams;
      cs.erase(std::remove_if(cs.begin(), cs.end(), [](const auto& w) { return w.expired(); }),
               cs.end());
      for (const auto& w : cs)
        if (auto c = w.lock()) comms.push_back(std::move(c));
      for (CpuStream* t : gpu().trainer_streams) t->drain();
    }
    // The communicators' streams last: their collectives wait for markers on the streams above.
    for (const auto& c : comms) c->drain();
  }

  cpu::Arena& arena_;
  std::vector<float> wide_;  // muon_average()'s, on the one stream the engine issues it on
  const uint64_t seed_;
  const int jitter_us_;
  const AsyncComm comm_;
  std::mutex mu_;  // guards the list
  std::vector<std::unique_ptr<CpuStream>> streams_;
  std::shared_ptr<WaitingHeap> heap_;  // device memory
  WaitingHeap pinned_;                 // pinned host memory
  double device_sums_[2] = {0, 0};
  double host_sums_[2] = {0, 0};
};

}  // namespace

AsyncTrainerStream::AsyncTrainerStream(uint64_t seed, int jitter_us)
    : handle_(new CpuStream(seed, jitter_us)) {
  std::lock_guard<std::mutex> lock(gpu().mu);
  gpu().trainer_streams.push_back(static_cast<CpuStream*>(handle_));
}

AsyncTrainerStream::~AsyncTrainerStream() {
  {
    std::lock_guard<std::mutex> lock(gpu().mu);
    auto& live = gpu().trainer_streams;
    live.erase(std::find(live.begin(), live.end(), handle_));
  }
  delete static_cast<CpuStream*>(handle_);  // finishes what was issued
}

void AsyncTrainerStream::issue(std::function<void()> work) {
  static_cast<CpuStream*>(handle_)->issue(std::move(work));
}

void AsyncTrainerStream::synchronize() {
  static_cast<CpuStream*>(handle_)->synchronize();
}

std::unique_ptr<Compute> make_async_cpu_compute(cpu::Arena& arena, uint64_t seed, int jitter_us,
                                                AsyncComm comm) {
  return make_stream_compute(std::make_unique<AsyncCpuDevice>(arena, seed, jitter_us, comm));
}

}  // namespace zeroshard
