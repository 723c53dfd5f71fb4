// NCCL's ordering on the asynchronous CPU device (the contract is in
// async_device_communicator.hpp): every collective is queued on a communication stream behind a
// marker of the input stream, and runs on the host communicator when the stream reaches it.

#include "src/compute/async_device_communicator.hpp"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <exception>
#include <mutex>
#include <numeric>
#include <string>
#include <utility>
#include <vector>

#include "base/check.hpp"
#include "base/gate.hpp"
#include "base/pieces.hpp"
#include "src/compute/cpu_stream.hpp"
#include "src/compute/device_communicator.hpp"

namespace zeroshard {
namespace {

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

using Clock = std::chrono::steady_clock;

// A collective queued on the communication stream. Done once the stream ran it, or once its
// timeout passed (counted from the call, as NCCL's); settled once the host collective no longer
// touches its buffers.
class StreamWork final : public Work {
 public:
  StreamWork(std::string what, double timeout_s)
      : what_(std::move(what)),
        started_(now_s()),
        deadline_(Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                     std::chrono::duration<double>(std::min(timeout_s, 1e7)))) {}
  ~StreamWork() override {
    // Host memory staged for the collective (keep_) that a collective which timed out may still
    // write into: kept for good, as small as the doubles or bytes it stages.
    std::lock_guard<std::mutex> lock(mu_);
    if (keep_ && !(ran_ && (!inner_ || inner_->wait_settled(0))))
      new std::shared_ptr<void>(std::move(keep_));
  }
  void wait() override {
    std::unique_lock<std::mutex> lock(mu_);
    if (!cv_.wait_until(lock, deadline_, [&] { return done_; })) {
      fail_locked(std::make_exception_ptr(
          Error(ErrorCode::timeout, what_ + ": timed out, still queued behind the work it "
                                            "follows on the device")));
      timed_out_ = true;
    }
    if (error_) std::rethrow_exception(error_);
  }
  bool done() override {
    std::lock_guard<std::mutex> lock(mu_);
    return done_;
  }
  bool wait_settled(double max_seconds) override {
    const auto until =
        Clock::now() + std::chrono::duration_cast<Clock::duration>(
                           std::chrono::duration<double>(std::min(max_seconds, 1e7)));
    std::shared_ptr<Work> inner;
    {
      std::unique_lock<std::mutex> lock(mu_);
      if (!cv_.wait_until(lock, until, [&] { return ran_; })) return false;
      inner = inner_;
    }
    const double left = std::chrono::duration<double>(until - Clock::now()).count();
    return !inner || inner->wait_settled(std::max(0.0, left));
  }
  double started_at() override { return started_; }
  double finished_at() override {
    std::lock_guard<std::mutex> lock(mu_);
    return finished_;
  }
  bool timed_out() {
    std::lock_guard<std::mutex> lock(mu_);
    return timed_out_;
  }
  // The stream ran it: `inner` is the host collective (null: it was not started), `error` what
  // it threw.
  void ran(std::shared_ptr<Work> inner, std::exception_ptr error) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      inner_ = std::move(inner);
      ran_ = true;
      fail_locked(std::move(error));
    }
    cv_.notify_all();
  }
  void keep(std::shared_ptr<void> p) { keep_ = std::move(p); }

 private:
  void fail_locked(std::exception_ptr error) {
    if (done_) return;  // the first outcome stands
    done_ = true;
    error_ = std::move(error);
    finished_ = now_s();
  }

  const std::string what_;
  const double started_;
  const Clock::time_point deadline_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false, ran_ = false, timed_out_ = false;  // guarded by mu_, as are the rest
  std::exception_ptr error_;
  double finished_ = 0;
  std::shared_ptr<Work> inner_;
  std::shared_ptr<void> keep_;
};

// How many collectives the communication stream has run, for order_before()'s waits, and
// whether a timeout made the communicator unusable (shared: a stream's wait may outlive the
// communicator).
struct Progress {
  std::mutex mu;
  std::condition_variable cv;
  uint64_t finished = 0;  // guarded by mu
  std::atomic<bool> unusable{false};
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
  AsyncDeviceCommunicator(std::shared_ptr<Communicator> own, AsyncCommHooks hooks, uint64_t seed,
                          int jitter_us)
      : host_(std::move(own)),
        hooks_(std::move(hooks)),
        seed_(seed),
        jitter_us_(jitter_us),
        stream_(std::make_shared<CpuStream>(seed, jitter_us)) {
    if (hooks_.enroll) hooks_.enroll(stream_);
  }
  // stream_ finishes the collectives queued (its destructor), before host_ goes.
  ~AsyncDeviceCommunicator() override { stream_.reset(); }

  int rank() const override { return host_->rank(); }
  int size() const override { return host_->size(); }
  int device() const override { return -1; }  // the asynchronous CPU device
  void set_timeout(double seconds) override {
    timeout_s_.store(seconds);
    host_->set_timeout(seconds);
  }

  std::shared_ptr<Work> reduce_scatter(const void* send, void* recv, int64_t recv_count,
                                       DType dtype, std::string what) override {
    const std::string name = "reduce_scatter of " + what;
    if (empty(recv_count, name)) return finished(name);
    require_device(send, name, "send");
    require_device(recv, name, "recv");
    return submit(name,
                  [=, this] { return host_->reduce_scatter(send, recv, recv_count, dtype, what); });
  }
  std::shared_ptr<Work> all_gather(const void* send, void* recv, int64_t send_count, DType dtype,
                                   std::string what) override {
    const std::string name = "all_gather of " + what;
    if (empty(send_count, name)) return finished(name);
    require_device(send, name, "send");
    require_device(recv, name, "recv");
    return submit(name,
                  [=, this] { return host_->all_gather(send, recv, send_count, dtype, what); });
  }
  std::shared_ptr<Work> all_reduce_sum(void* inout, int64_t count, DType dtype,
                                       std::string what) override {
    const std::string name = "all_reduce of " + what;
    if (empty(count, name)) return finished(name);
    require_device(inout, name, "inout");
    return submit(name, [=, this] { return host_->all_reduce_sum(inout, count, dtype, what); });
  }
  std::shared_ptr<Work> all_reduce(double* inout, int64_t count, ReduceOp op,
                                   std::string what) override {
    const std::string name = "all_reduce of " + what;
    if (empty(count, name)) return finished(name);
    if (hooks_.is_device(inout))
      return submit(name, [=, this] { return host_->all_reduce(inout, count, op, what); });
    // Host doubles are copied in now and back once the collective ran, as NCCL stages them.
    auto staged = std::make_shared<std::vector<double>>(inout, inout + count);
    return submit(
        name, [=, this] { return host_->all_reduce(staged->data(), count, op, what); },
        [=] { std::copy(staged->begin(), staged->end(), inout); }, staged);
  }
  std::shared_ptr<Work> broadcast(void* data, int64_t bytes, int root, std::string what) override {
    const std::string name = "broadcast of " + what;
    if (root < 0 || root >= size())
      ZS_THROW(invalid_argument, "rank " << rank() << ": " << name << ": bad root " << root
                                         << " (world size " << size() << ")");
    if (empty(bytes, name)) return finished(name);
    if (hooks_.is_device(data))
      return submit(name, [=, this] { return host_->broadcast(data, bytes, root, what); });
    const char* in = static_cast<const char*>(data);
    auto staged = std::make_shared<std::vector<char>>(in, in + bytes);
    return submit(
        name, [=, this] { return host_->broadcast(staged->data(), bytes, root, what); },
        [=] { std::copy(staged->begin(), staged->end(), static_cast<char*>(data)); }, staged);
  }
  std::shared_ptr<Work> all_to_all(const void* send, const Pieces& sends, void* recv,
                                   const Pieces& recvs, DType dtype, std::string what) override {
    const std::string name = "all_to_all of " + what;
    check_pieces(sends, rank(), size(), what, "send");
    check_pieces(recvs, rank(), size(), what, "recv");
    // The host communicator's all-to-all is a collective even where this rank moves nothing
    // (NCCL's point-to-point calls are not), so it always runs.
    if (!pieces_empty(sends)) require_device(send, name, "send");
    if (!pieces_empty(recvs)) require_device(recv, name, "recv");
    return submit(name,
                  [=, this] { return host_->all_to_all(send, sends, recv, recvs, dtype, what); });
  }
  void barrier(std::string what) override {
    // A one-element all-reduce, as NCCL's barrier: complete once every rank joined it.
    auto token = std::make_shared<double>(0.0);
    submit(
        "barrier " + what,
        [=, this] { return host_->all_reduce(token.get(), 1, ReduceOp::sum, "barrier " + what); },
        {}, token)
        ->wait();
  }
  std::shared_ptr<Communicator> split(const std::vector<int>& ranks, std::string what) override {
    // Once the stream has run every collective called so far, and while no other call can
    // queue one (mu_), this thread is the host communicator's only caller: the split takes the
    // same place in every rank's sequence.
    std::lock_guard<std::mutex> lock(mu_);
    progress_->wait_for(called_);
    return std::make_shared<AsyncDeviceCommunicator>(host_->split(ranks, what), hooks_,
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
  // A count of zero moves nothing and is no collective (NCCL's empty Work); a negative one is
  // refused, as NCCL refuses it.
  bool empty(int64_t count, const std::string& name) const {
    if (count < 0)
      ZS_THROW(invalid_argument, "rank " << rank() << ": " << name << ": negative count " << count);
    return count == 0;
  }
  std::shared_ptr<Work> finished(const std::string& name) const {
    auto w = std::make_shared<StreamWork>("rank " + std::to_string(rank()) + ": " + name, 0);
    w->ran(nullptr, nullptr);
    return w;
  }
  // Queues `start` (which starts the host collective) on the communication stream behind a
  // marker of the input stream; `after` runs once it completed (a copy back of staged host
  // memory, which `keep` holds).
  std::shared_ptr<Work> submit(const std::string& name,
                               std::function<std::shared_ptr<Work>()> start,
                               std::function<void()> after = {}, std::shared_ptr<void> keep = {}) {
    const std::string what = "rank " + std::to_string(rank()) + ": " + name;
    auto work = std::make_shared<StreamWork>(what, timeout_s_.load());
    work->keep(keep);
    auto gate = std::make_shared<Gate>();
    std::lock_guard<std::mutex> lock(mu_);
    if (input_)
      input_->issue([gate] { gate->open(); });
    else
      gate->open();
    ++called_;
    stream_->issue([gate, work, what, progress = progress_, start = std::move(start),
                    after = std::move(after), keep = std::move(keep)] {
      gate->wait();
      std::shared_ptr<Work> inner;
      std::exception_ptr error;
      try {
        if (progress->unusable.load())
          ZS_THROW(comm_failure, what << " refused: the communicator is unusable after an "
                                         "earlier timeout");
        inner = start();
        inner->wait();
        if (after) after();
      } catch (...) {
        error = std::current_exception();
      }
      // A collective that timed out on the host, or while queued, leaves the ranks out of step.
      if (error || work->timed_out()) progress->unusable.store(true);
      work->ran(std::move(inner), std::move(error));
      progress->advance();
    });
    return work;
  }
  void require_device(const void* p, const std::string& what, const char* name) const {
    if (!hooks_.is_device(p))
      ZS_THROW(invalid_argument, "rank " << rank() << ": " << what << ": " << name << " (" << p
                                         << ") is not device memory; the NCCL communicator "
                                            "moves buffers of the device (the asynchronous CPU "
                                            "device plays it)");
  }

  std::shared_ptr<Communicator> host_;
  const AsyncCommHooks hooks_;
  const uint64_t seed_;
  const int jitter_us_;
  std::atomic<double> timeout_s_{300.0};
  std::shared_ptr<Progress> progress_ = std::make_shared<Progress>();
  std::mutex mu_;  // guards the two below, and the order of issue
  CpuStream* input_ = nullptr;
  uint64_t called_ = 0;
  std::shared_ptr<CpuStream> stream_;  // the communication stream
};

}  // namespace

std::shared_ptr<Communicator> order_like_nccl(std::shared_ptr<Communicator> host,
                                              AsyncCommHooks hooks, uint64_t seed, int jitter_us) {
  ZS_CHECK(host != nullptr && hooks.is_device);
  std::vector<int> all(size_t(host->size()));
  std::iota(all.begin(), all.end(), 0);
  return std::make_shared<AsyncDeviceCommunicator>(
      host->split(all, "the NCCL-ordered collectives of the asynchronous CPU device"),
      std::move(hooks), seed, jitter_us);
}

}  // namespace zeroshard
