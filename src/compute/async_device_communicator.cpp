// NCCL's ordering on the asynchronous CPU device (the contract is in
// async_device_communicator.hpp): every collective is queued on a communication stream behind a
// marker of the input stream, and runs on the host communicator when the stream reaches it.

#include "src/compute/async_device_communicator.hpp"

#include <chrono>
#include <condition_variable>
#include <exception>
#include <mutex>
#include <numeric>
#include <string>
#include <utility>
#include <vector>

#include "base/check.hpp"
#include "src/compute/cpu_stream.hpp"
#include "src/compute/device_communicator.hpp"

namespace zeroshard {
namespace {

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// A one-shot flag one thread opens and another waits for: an event recorded on the input stream.
class Gate {
 public:
  void open() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      open_ = true;
    }
    cv_.notify_all();
  }
  void wait() {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return open_; });
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool open_ = false;
};

// A collective queued on the communication stream: done once the stream ran it.
class StreamWork final : public Work {
 public:
  StreamWork() : started_(now_s()) {}
  void wait() override {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return done_; });
    if (error_) std::rethrow_exception(error_);
  }
  bool done() override {
    std::lock_guard<std::mutex> lock(mu_);
    return done_;
  }
  bool wait_settled(double max_seconds) override {
    std::unique_lock<std::mutex> lock(mu_);
    return cv_.wait_for(lock, std::chrono::duration<double>(std::min(max_seconds, 1e7)),
                        [&] { return done_; });
  }
  double started_at() override { return started_; }
  double finished_at() override {
    std::lock_guard<std::mutex> lock(mu_);
    return finished_;
  }
  void finish(std::exception_ptr error) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      done_ = true;
      error_ = std::move(error);
      finished_ = now_s();
    }
    cv_.notify_all();
  }

 private:
  const double started_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;  // guarded by mu_, as are the two below
  std::exception_ptr error_;
  double finished_ = 0;
};

// How many collectives the communication stream has run, for order_before()'s waits (shared:
// a stream's wait may outlive the communicator).
struct Progress {
  std::mutex mu;
  std::condition_variable cv;
  uint64_t finished = 0;  // guarded by mu
  void advance() {
    {
      std::lock_guard<std::mutex> lock(mu);
      ++finished;
    }
    cv.notify_all();
  }
  void wait_for(uint64_t target) {
    std::unique_lock<std::mutex> lock(mu);
    cv.wait(lock, [&] { return finished >= target; });
  }
};

class AsyncDeviceCommunicator final : public DeviceCommunicator {
 public:
  AsyncDeviceCommunicator(std::shared_ptr<Communicator> own,
                          std::function<bool(const void*)> is_device, uint64_t seed, int jitter_us)
      : host_(std::move(own)),
        is_device_(std::move(is_device)),
        seed_(seed),
        jitter_us_(jitter_us),
        stream_(seed, jitter_us) {}

  int rank() const override { return host_->rank(); }
  int size() const override { return host_->size(); }
  int device() const override { return 0; }
  void set_timeout(double seconds) override { host_->set_timeout(seconds); }

  std::shared_ptr<Work> reduce_scatter(const void* send, void* recv, int64_t recv_count,
                                       DType dtype, std::string what) override {
    const std::string name = "reduce_scatter of " + what;
    if (recv_count <= 0) return host_->reduce_scatter(send, recv, recv_count, dtype, what);
    require_device(send, name, "send");
    require_device(recv, name, "recv");
    return submit([=, this] { host_->reduce_scatter(send, recv, recv_count, dtype, what)->wait(); });
  }
  std::shared_ptr<Work> all_gather(const void* send, void* recv, int64_t send_count, DType dtype,
                                   std::string what) override {
    const std::string name = "all_gather of " + what;
    if (send_count <= 0) return host_->all_gather(send, recv, send_count, dtype, what);
    require_device(send, name, "send");
    require_device(recv, name, "recv");
    return submit([=, this] { host_->all_gather(send, recv, send_count, dtype, what)->wait(); });
  }
  std::shared_ptr<Work> all_reduce_sum(void* inout, int64_t count, DType dtype,
                                       std::string what) override {
    if (count <= 0) return host_->all_reduce_sum(inout, count, dtype, what);
    require_device(inout, "all_reduce of " + what, "inout");
    return submit([=, this] { host_->all_reduce_sum(inout, count, dtype, what)->wait(); });
  }
  std::shared_ptr<Work> all_reduce(double* inout, int64_t count, ReduceOp op,
                                   std::string what) override {
    if (count <= 0 || is_device_(inout))
      return count <= 0 ? host_->all_reduce(inout, count, op, what)
                        : submit([=, this] { host_->all_reduce(inout, count, op, what)->wait(); });
    // Host doubles are copied in now and back once the collective ran, as NCCL stages them.
    auto staged = std::make_shared<std::vector<double>>(inout, inout + count);
    return submit([=, this] {
      host_->all_reduce(staged->data(), count, op, what)->wait();
      std::copy(staged->begin(), staged->end(), inout);
    });
  }
  std::shared_ptr<Work> broadcast(void* data, int64_t bytes, int root, std::string what) override {
    if (bytes <= 0 || is_device_(data))
      return bytes <= 0 ? host_->broadcast(data, bytes, root, what)
                        : submit([=, this] { host_->broadcast(data, bytes, root, what)->wait(); });
    const char* in = static_cast<const char*>(data);
    auto staged = std::make_shared<std::vector<char>>(in, in + bytes);
    return submit([=, this] {
      host_->broadcast(staged->data(), bytes, root, what)->wait();
      std::copy(staged->begin(), staged->end(), static_cast<char*>(data));
    });
  }
  void barrier(std::string what) override {
    submit([=, this] { host_->barrier(what); })->wait();
  }
  std::shared_ptr<Communicator> split(const std::vector<int>& ranks, std::string what) override {
    // Once the stream has run every collective called so far, this thread is the host
    // communicator's only caller: the split takes the same place in every rank's sequence.
    drain();
    return std::make_shared<AsyncDeviceCommunicator>(host_->split(ranks, what), is_device_,
                                                     seed_ + 7919, jitter_us_);
  }

  void set_input_stream(void* stream) override {
    std::lock_guard<std::mutex> lock(mu_);
    input_ = static_cast<CpuStream*>(stream);
  }
  void order_before(void* stream) override {
    std::lock_guard<std::mutex> lock(mu_);
    static_cast<CpuStream*>(stream)->issue(
        [progress = progress_, target = called_] { progress->wait_for(target); });
  }

 private:
  // Queues `run` (the collective, to completion) on the communication stream behind a marker of
  // the input stream.
  std::shared_ptr<Work> submit(std::function<void()> run) {
    auto work = std::make_shared<StreamWork>();
    auto gate = std::make_shared<Gate>();
    std::lock_guard<std::mutex> lock(mu_);
    if (input_)
      input_->issue([gate] { gate->open(); });
    else
      gate->open();
    ++called_;
    stream_.issue([gate, work, progress = progress_, run = std::move(run)] {
      gate->wait();
      std::exception_ptr error;
      try {
        run();
      } catch (...) {
        error = std::current_exception();
      }
      work->finish(std::move(error));
      progress->advance();
    });
    return work;
  }
  void drain() {
    uint64_t target = 0;
    {
      std::lock_guard<std::mutex> lock(mu_);
      target = called_;
    }
    progress_->wait_for(target);
  }
  void require_device(const void* p, const std::string& what, const char* name) const {
    if (!is_device_(p))
      ZS_THROW(invalid_argument, "rank " << rank() << ": " << what << ": " << name << " (" << p
                                         << ") is not device memory; the NCCL communicator "
                                            "moves buffers of the device (the asynchronous CPU "
                                            "device plays it)");
  }

  std::shared_ptr<Communicator> host_;
  std::function<bool(const void*)> is_device_;
  const uint64_t seed_;
  const int jitter_us_;
  std::shared_ptr<Progress> progress_ = std::make_shared<Progress>();
  std::mutex mu_;              // guards the two below, and the order of issue
  CpuStream* input_ = nullptr;
  uint64_t called_ = 0;
  CpuStream stream_;  // last: destroyed first, finishing the collectives queued
};

}  // namespace

std::shared_ptr<Communicator> order_like_nccl(std::shared_ptr<Communicator> host,
                                              std::function<bool(const void*)> is_device,
                                              uint64_t seed, int jitter_us) {
  ZS_CHECK(host != nullptr);
  std::vector<int> all(size_t(host->size()));
  std::iota(all.begin(), all.end(), 0);
  return std::make_shared<AsyncDeviceCommunicator>(
      host->split(all, "the NCCL-ordered collectives of the asynchronous CPU device"),
      std::move(is_device), seed, jitter_us);
}

}  // namespace zeroshard
