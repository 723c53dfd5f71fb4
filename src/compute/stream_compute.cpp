// Compute on a StreamDevice: the GPU backend's ordering, once, for CUDA and for the asynchronous
// CPU device alike. The engine's element-wise work goes on one compute stream (the engine's own,
// or the trainer's); downloads of finished collectives' outputs take a copy stream of their own,
// so they do not wait behind the kernels queued after them; collectives follow the compute
// stream on the device (a DeviceCommunicator) or after the host waited for it (any other).

#include <algorithm>
#include <iterator>
#include <string>
#include <utility>
#include <vector>

#include "base/check.hpp"
#include "src/compute/compute.hpp"
#include "src/compute/device_communicator.hpp"
#include "src/compute/stream_device.hpp"

namespace zeroshard {
namespace {

class StreamCompute final : public Compute {
 public:
  explicit StreamCompute(std::unique_ptr<StreamDevice> device) : d_(std::move(device)) {
    own_ = d_->create_stream();
    d2h_ = d_->create_stream();
    stream_ = own_;
  }
  ~StreamCompute() override {
    // The engine's buffers were freed before this, each free waiting for the streams
    // (Engine::~Engine); the communicator outlives this, so it must not keep waiting on a
    // stream about to go.
    for (DeviceCommunicator* c : device_comms_) c->set_input_stream(nullptr);
  }

  Device device() const override { return d_->device(); }
  int device_index() const override { return d_->device_index(); }
  bool streams() const override { return true; }
  Allocator* device_memory() override { return d_->device_memory(); }
  Allocator* pinned_memory() override { return d_->pinned_memory(); }

  void fill(void* p, unsigned char value, size_t bytes) override {
    if (bytes) d_->fill(p, value, bytes, stream_);
  }
  void convert(const void* src, DType sd, void* dst, DType dd, int64_t n) override {
    if (n > 0 && !(src == dst && sd == dd)) d_->convert(src, sd, dst, dd, n, stream_);
  }
  void accumulate(float* acc, const void* g, DType gd, int64_t n) override {
    if (n > 0) d_->accumulate(acc, g, gd, n, stream_);
  }
  void update(const std::vector<cpu::UpdateHyper>& hyper,
              const std::vector<UnitUpdate>& units) override {
    const auto held = [&](const GroupRun& r) { return hyper[size_t(r.group)].hold; };
    for (const UnitUpdate& u : units) {
      if (std::none_of(u.runs->begin(), u.runs->end(), held)) {
        d_->update(hyper, u, stream_);  // one launch per unit
        continue;
      }
      // Held runs (UpdateHyper::hold) leave the update's launch: their parameters are only
      // rewritten from the master. The device copies the runs at the launch.
      std::vector<GroupRun> active;
      std::copy_if(u.runs->begin(), u.runs->end(), std::back_inserter(active),
                   [&](const GroupRun& r) { return !held(r); });
      UnitUpdate rest = u;
      rest.runs = &active;
      if (!active.empty()) d_->update(hyper, rest, stream_);
      const cpu::UpdateArgs& a = u.args;
      for (const GroupRun& r : *u.runs)
        if (held(r) && a.out)
          d_->convert(
              static_cast<const char*>(a.master) + size_t(r.begin) * dtype_size(a.master_dtype),
              a.master_dtype, static_cast<char*>(a.out) + size_t(r.begin) * dtype_size(a.out_dtype),
              a.out_dtype, r.end - r.begin, stream_);
    }
  }
  void muon_average(const cpu::UpdateArgs& a, const cpu::UpdateHyper& h, int64_t lo, int64_t hi,
                    float* d) override {
    if (lo < hi) d_->muon_average(a, h, lo, hi, d, stream_);
  }
  void newton_schulz(float* x, int64_t rows, int64_t cols, const cpu::NsOptions& o,
                     float* scratch) override {
    if (rows > 0 && cols > 0) d_->newton_schulz(x, rows, cols, o, scratch, stream_);
  }
  std::pair<double, bool> sum_squares(const std::vector<GradSpan>& spans) override {
    bool first = true;
    for (const GradSpan& s : spans) {
      if (s.n <= 0) continue;
      d_->sum_squares(s, d_->device_sums(), !first, stream_);
      first = false;
    }
    if (first) return {0.0, false};
    double* h = d_->host_sums();
    d_->copy(h, d_->device_sums(), 2 * sizeof(double), stream_);
    d_->sync_stream(stream_);
    return {h[0], h[1] != 0.0};
  }
  void copy(void* dst, const void* src, size_t bytes) override {
    if (bytes) d_->copy(dst, src, bytes, stream_);
  }
  void download(void* host, const void* dev, size_t bytes) override {
    if (!bytes) return;
    d_->copy(host, dev, bytes, d2h_);
    d_->sync_stream(d2h_);
  }
  void synchronize() override { d_->sync_stream(stream_); }
  void hand_to_trainer() override {
    // A trainer on the device queues its work on stream() after ours; one on the host has no
    // stream to queue on, so it waits.
    if (!d_->public_handle(stream_)) synchronize();
  }
  std::shared_ptr<void> register_host(void* p, size_t bytes) override {
    return d_->register_host(p, bytes);
  }

  std::shared_ptr<Communicator> adapt(std::shared_ptr<Communicator> comm) override {
    // A communicator that moves device memory itself (NCCL) is ordered with the compute stream on
    // the device; any other is made to take device memory (carry(): staged through host memory,
    // or on the asynchronous CPU device ordered as NCCL's). An engine with hierarchical sharding
    // adapts its group communicators too.
    DeviceCommunicator* dc = as_device_communicator(comm.get());
    if (!dc) {
      comm = d_->carry(std::move(comm));
      dc = as_device_communicator(comm.get());
      if (!dc) return comm;
    } else if (!d_->takes(*dc)) {
      const auto on = [](bool cuda, int index) {
        return cuda && index >= 0 ? "GPU " + std::to_string(index)
                                  : std::string("the asynchronous CPU device");
      };
      ZS_THROW(invalid_argument, "Engine: the NCCL communicator is on "
                                     << on(true, dc->device()) << " but the engine on "
                                     << on(d_->device() == Device::cuda, d_->device_index())
                                     << " (zeroshard.device_index)");
    }
    device_comms_.push_back(dc);
    return comm;
  }
  void before_collective() override {
    // NCCL waits for the compute stream on the device (set per call: engines may share the
    // communicator); any other backend reads device memory from the host (staged copies), so
    // the work that wrote it must be done.
    if (device_comms_.empty()) synchronize();
    for (DeviceCommunicator* c : device_comms_) c->set_input_stream(stream_);
  }

  void* stream() const override { return d_->public_handle(stream_); }
  void set_stream(void* s) override {
    StreamDevice::Stream next = s ? d_->adopt_stream(s) : own_;
    synchronize();
    stream_ = next;
    // NCCL follows the new stream from now on, also in collectives no before_collective() precedes
    // (the old stream may be gone by then).
    for (DeviceCommunicator* c : device_comms_) c->set_input_stream(stream_);
  }

 private:
  std::unique_ptr<StreamDevice> d_;
  StreamDevice::Stream own_ = nullptr;     // the engine's compute stream
  StreamDevice::Stream stream_ = nullptr;  // the one work is issued on: own_, or the trainer's
  StreamDevice::Stream d2h_ = nullptr;     // downloads of finished collectives' outputs
  std::vector<DeviceCommunicator*> device_comms_;  // the engine's communicators that order by
                                                   // streams (NCCL's)
};

}  // namespace

std::unique_ptr<Compute> make_stream_compute(std::unique_ptr<StreamDevice> device) {
  ZS_CHECK(device != nullptr);
  return std::make_unique<StreamCompute>(std::move(device));
}

}  // namespace zeroshard
