// The Open MPI communicator. One communication thread starts every collective (non-blocking,
// MPI-3) in submission order and drives them with MPI_Test, so several can be in flight while
// the trainer computes, and none can hang the process: each has a deadline.
#include <mpi.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <climits>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

#include "base/check.hpp"
#include "base/mpi_check.hpp"
#include "base/pieces.hpp"
#include "kernels/cpu/cpu_kernels.hpp"
#include "src/comm/mpi/peer_probe.hpp"
#include "src/comm/seconds_text.hpp"
#include "src/comm/split_check.hpp"
#include "src/comm/timeout.hpp"
#include "src/comm/work_state.hpp"
#include "zeroshard/communicator.hpp"
#include "zeroshard/launch.hpp"

namespace zeroshard {
namespace {

// Element-wise sums of bf16 / f16 in f32 with one rounding per addition (the reduction operator
// every rank applies identically, so results do not depend on which rank reduces).
void bf16_sum(void* in, void* inout, int* len, MPI_Datatype*) {
  cpu::add_into(cpu::best_isa(), inout, in, DType::bf16, *len);
}
void f16_sum(void* in, void* inout, int* len, MPI_Datatype*) {
  cpu::add_into(cpu::best_isa(), inout, in, DType::f16, *len);
}

// A launch whose processes MPI cannot join into one world would either abort in MPI_Init with a
// message about rebuilding MPI (srun without a PMI plugin) or, worse, give every process a world
// of its own that trains alone (torchrun): refused before MPI starts, saying what to run instead.
void refuse_unjoinable_launch() {
  const LaunchInfo li = launch_info();
  if (li.mpi_world) return;
  if (li.launcher == "srun")
    ZS_THROW(comm_failure, "srun started this process as task "
                               << li.rank << " of " << li.world_size
                               << " without a PMI plugin, so MPI cannot find the other tasks: "
                                  "launch with `srun --mpi=pmix ...` (or set MpiDefault=pmix in "
                                  "slurm.conf)");
  ZS_THROW(comm_failure, li.launcher << " started this process as rank " << li.rank << " of "
                                     << li.world_size
                                     << " without MPI, so MPI cannot join the ranks into one "
                                        "world: launch with `mpirun -np "
                                     << li.world_size
                                     << " ...` (or, on GPUs from Python, zeroshard's torchrun "
                                        "bootstrap: zeroshard.default_communicator(device))");
}

// Process-wide MPI state: initialised once, finalised when the last holder goes away or at
// finalize_mpi(), whichever comes first.
struct MpiRuntime {
  bool we_initialized = false;
  // A collective of this process timed out on peers that no longer answered (frozen, failed
  // alone, or cut off) and never completed: MPI_Finalize would wait for them, so the end of the
  // process aborts the job instead. (Peers that answer but called another collective finalise.)
  std::atomic<bool> peer_lost{false};
  MPI_Op op_bf16 = MPI_OP_NULL, op_f16 = MPI_OP_NULL;

  MpiRuntime() {
    int inited = 0;
    ZS_MPI_CHECK(MPI_Initialized(&inited));
    int provided = 0;
    if (!inited) {
      refuse_unjoinable_launch();
      ZS_MPI_CHECK(MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided));
      we_initialized = true;
    } else {
      ZS_MPI_CHECK(MPI_Query_thread(&provided));
    }
    if (provided < MPI_THREAD_MULTIPLE)
      ZS_THROW(comm_failure, "MPI provides thread level "
                                 << provided
                                 << " but zeroshard needs MPI_THREAD_MULTIPLE (its communication "
                                    "thread calls MPI while the trainer may too); initialise MPI "
                                    "with MPI_Init_thread(MPI_THREAD_MULTIPLE)");
    // Open MPI reports some errors of non-blocking collectives (MPI_ERR_TRUNCATE when ranks
    // called different ones) through MPI_COMM_WORLD's handler, not the communicator's: with the
    // default there, MPI_ERRORS_ARE_FATAL, they abort the job instead of failing the collective.
    ZS_MPI_CHECK(MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN));
    ZS_MPI_CHECK(MPI_Op_create(&bf16_sum, 1, &op_bf16));
    ZS_MPI_CHECK(MPI_Op_create(&f16_sum, 1, &op_f16));
  }
  ~MpiRuntime() { finalize(); }
  // Idempotent. Communicators still alive are closed first (finalize_mpi()).
  void finalize() {
    {
      // Held while closing: a communicator destroyed meanwhile waits in remove().
      std::lock_guard<std::mutex> lock(live_mu);
      for (auto& [owner, close] : live) close();
      live.clear();
    }
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (finalized || done) return;
    done = true;
    if (we_initialized && peer_lost) {
      std::fprintf(stderr,
                   "zeroshard: a collective of this rank timed out on peers that no longer "
                   "answer; aborting the MPI job rather than waiting for them in MPI_Finalize\n");
      std::fflush(stderr);
      MPI_Abort(MPI_COMM_WORLD, 1);
    }
    MPI_Op_free(&op_bf16);
    MPI_Op_free(&op_f16);
    if (we_initialized) MPI_Finalize();
  }
  // A live communicator: what finalize() calls to finish, close it and refuse what comes later.
  void add(const void* owner, std::function<void()> close) {
    std::lock_guard<std::mutex> lock(live_mu);
    live.emplace_back(owner, std::move(close));
  }
  void remove(const void* owner) {
    std::lock_guard<std::mutex> lock(live_mu);
    std::erase_if(live, [owner](const auto& l) { return l.first == owner; });
  }
  std::mutex live_mu;
  std::vector<std::pair<const void*, std::function<void()>>> live;  // not yet closed
  bool done = false;                                                // finalize() ran
  // The sum of `dtype`: MPI's own for f32, the ones above for bf16 and f16.
  MPI_Op sum(DType dtype) const {
    return dtype == DType::f32 ? MPI_SUM : dtype == DType::bf16 ? op_bf16 : op_f16;
  }
  static std::shared_ptr<MpiRuntime> get() {
    // Held by this static and by every communicator: MPI_Finalize runs at process exit, after
    // the last communicator is gone, and never twice.
    static std::shared_ptr<MpiRuntime> rt = std::make_shared<MpiRuntime>();
    return rt;
  }
};

// Memory that MPI may still use after a request was abandoned: kept, and reachable (so that a
// leak checker does not report it), until the process ends.
void keep_until_exit(std::shared_ptr<void> p) {
  static std::mutex mu;
  static auto* kept = new std::vector<std::shared_ptr<void>>();
  std::lock_guard<std::mutex> lock(mu);
  kept->push_back(std::move(p));
}

MPI_Datatype mpi_type(DType t) {
  return t == DType::f32 ? MPI_FLOAT : MPI_UINT16_T;
}

int checked_count(int64_t n, const std::string& what) {
  if (n < 0 || n > INT_MAX)
    ZS_THROW(invalid_argument, what << ": " << n << " elements exceed MPI's int count");
  return int(n);
}

class MpiCommunicator final : public Communicator {
 public:
  MpiCommunicator() : rt_(MpiRuntime::get()) {
    ZS_MPI_CHECK(MPI_Comm_dup(MPI_COMM_WORLD, &comm_));
    open();
  }
  // Takes `comm` over (split()).
  MpiCommunicator(std::shared_ptr<MpiRuntime> rt, MPI_Comm comm) : rt_(std::move(rt)), comm_(comm) {
    open();
  }

  ~MpiCommunicator() override {
    rt_->remove(this);
    close();
  }

  // finalize_mpi() with this communicator still alive: it closes now, and what is submitted
  // later fails at once.
  void close_for_finalize() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (poisoned_.empty()) poisoned_ = "MPI was finalised (finalize_mpi())";
    }
    close();
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }

  std::shared_ptr<Work> reduce_scatter(const void* send, void* recv, int64_t count, DType dtype,
                                       std::string what) override {
    int n = checked_count(count, what);
    MPI_Op op = rt_->sum(dtype);
    return submit(
        "reduce_scatter of " + what,
        [=, this](MPI_Request* r) {
          return MPI_Ireduce_scatter_block(send, recv, n, mpi_type(dtype), op, comm_, r);
        },
        " (" + std::to_string(n) + " " + dtype_name(dtype) + " per rank)");
  }

  std::shared_ptr<Work> all_gather(const void* send, void* recv, int64_t count, DType dtype,
                                   std::string what) override {
    int n = checked_count(count, what);
    // The caller's block already in place is MPI's in-place all-gather.
    const char* own =
        static_cast<const char*>(recv) + size_t(rank_) * size_t(n) * dtype_size(dtype);
    const void* src = send == own ? MPI_IN_PLACE : send;
    return submit(
        "all_gather of " + what,
        [=, this](MPI_Request* r) {
          return MPI_Iallgather(src, n, mpi_type(dtype), recv, n, mpi_type(dtype), comm_, r);
        },
        " (" + std::to_string(n) + " " + dtype_name(dtype) + " per rank)");
  }

  std::shared_ptr<Work> all_reduce(double* inout, int64_t count, ReduceOp op,
                                   std::string what) override {
    int n = checked_count(count, what);
    MPI_Op mop = op == ReduceOp::sum ? MPI_SUM : op == ReduceOp::max ? MPI_MAX : MPI_MIN;
    return submit(
        "all_reduce of " + what,
        [=, this](MPI_Request* r) {
          return MPI_Iallreduce(MPI_IN_PLACE, inout, n, MPI_DOUBLE, mop, comm_, r);
        },
        " (" + std::to_string(n) + " doubles)");
  }

  std::shared_ptr<Work> broadcast(void* data, int64_t bytes, int root, std::string what) override {
    int n = checked_count(bytes, what);
    return submit(
        "broadcast of " + what,
        [=, this](MPI_Request* r) { return MPI_Ibcast(data, n, MPI_BYTE, root, comm_, r); },
        " (" + std::to_string(n) + " bytes from rank " + std::to_string(root) + ")");
  }

  // MPI_Ialltoallv: its counts and displacements must outlive the call, so the collective keeps
  // them (Pending::keep) until it completes. The check compares only the dtype, as the pieces
  // differ from rank to rank.
  std::shared_ptr<Work> all_to_all(const void* send, const Pieces& sends, void* recv,
                                   const Pieces& recvs, DType dtype, std::string what) override {
    check_pieces(sends, rank_, size_, what, "send");
    check_pieces(recvs, rank_, size_, what, "recv");
    struct Ints {
      std::vector<int> send_counts, send_displs, recv_counts, recv_displs;
    };
    auto v = std::make_shared<Ints>();
    const auto ints = [&](const std::vector<int64_t>& from, std::vector<int>& to) {
      for (int64_t x : from) to.push_back(checked_count(x, "all_to_all of " + what));
    };
    ints(sends.counts, v->send_counts);
    ints(sends.offsets, v->send_displs);
    ints(recvs.counts, v->recv_counts);
    ints(recvs.offsets, v->recv_displs);
    const MPI_Datatype type = mpi_type(dtype);
    return submit(
        "all_to_all of " + what,
        [=, this, v = v.get()](MPI_Request* r) {
          return MPI_Ialltoallv(send, v->send_counts.data(), v->send_displs.data(), type, recv,
                                v->recv_counts.data(), v->recv_displs.data(), type, comm_, r);
        },
        " (" + std::string(dtype_name(dtype)) + ")", v);
  }

  void barrier(std::string what) override {
    submit("barrier " + what, [this](MPI_Request* r) { return MPI_Ibarrier(comm_, r); })->wait();
  }

  std::shared_ptr<Work> all_reduce_sum(void* inout, int64_t count, DType dtype,
                                       std::string what) override {
    int n = checked_count(count, what);
    MPI_Op op = rt_->sum(dtype);
    return submit(
        "all_reduce of " + what,
        [=, this](MPI_Request* r) {
          return MPI_Iallreduce(MPI_IN_PLACE, inout, n, mpi_type(dtype), op, comm_, r);
        },
        " (" + std::to_string(n) + " " + dtype_name(dtype) + ")");
  }

  // MPI_Comm_split blocks until every rank calls it: a barrier first, which times out, so that
  // a missing rank fails the split instead of hanging it. It runs on the communication thread,
  // in its place of the sequence of collectives. A group's smallest rank is its colour.
  std::shared_ptr<Communicator> split(const std::vector<int>& ranks, std::string what) override {
    check_split(ranks, rank_, size_, what);
    barrier("before the split of " + what);
    MPI_Comm sub = MPI_COMM_NULL;
    submit("split of " + what, [&, this](MPI_Request* r) {
      *r = MPI_REQUEST_NULL;  // done once it returns
      return MPI_Comm_split(comm_, ranks.front(), rank_, &sub);
    })->wait();
    auto c = std::make_shared<MpiCommunicator>(rt_, sub);
    c->set_timeout(timeout_s_.load());
    if (c->size() != int(ranks.size()))
      ZS_THROW(invalid_argument, "rank " << rank_ << ": split of " << what << ": the group of "
                                         << ranks.size() << " ranks has " << c->size()
                                         << " (the ranks passed groups that overlap)");
    return c;
  }

  void set_timeout(double seconds) override { timeout_s_.store(seconds); }

 private:
  // Lets the started collectives finish (or time out), stops the thread, frees the MPI
  // communicator. Once only.
  void close() {
    if (closed_) return;
    closed_ = true;
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    wake_.notify_one();
    thread_.join();
    // A collective abandoned after a timeout still references this communicator; freeing it
    // could crash MPI, so it is left to the process's end.
    probe_->close(abandoned_ != 0);
    if (abandoned_ == 0) MPI_Comm_free(&comm_);
    if (abandoned_ != 0 && peer_silent_) rt_->peer_lost = true;
  }

  void open() {
    ZS_MPI_CHECK(MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN));
    ZS_MPI_CHECK(MPI_Comm_rank(comm_, &rank_));
    ZS_MPI_CHECK(MPI_Comm_size(comm_, &size_));
    probe_ = std::make_unique<PeerProbe>(comm_);
    thread_ = std::thread([this] { run(); });
    rt_->add(this, [this] { close_for_finalize(); });
  }

  using Start = std::function<int(MPI_Request*)>;
  struct Pending {
    std::shared_ptr<WorkState> work;
    Start start;
    std::string desc;            // what this rank calls, compared across ranks in checking mode
    std::shared_ptr<void> keep;  // what MPI reads until the collective completes (all_to_all)
  };
  struct InFlight {
    std::shared_ptr<WorkState> work;
    MPI_Request req;
    std::chrono::steady_clock::time_point deadline;
    bool timed_out;
    // Checking mode: the descriptors are being all-gathered; the collective starts after.
    Start start;
    std::vector<char> descs;
    std::shared_ptr<void> keep;  // as Pending's; kept while a timed-out request may complete
  };
  static constexpr int kDescBytes = 160;

  std::shared_ptr<Work> submit(std::string what, Start start, std::string shape = "",
                               std::shared_ptr<void> keep = {}) {
    auto work = std::make_shared<WorkState>("rank " + std::to_string(rank_) + ": " + what);
    std::string desc = what + shape;
    std::lock_guard<std::mutex> lock(mu_);
    if (!poisoned_.empty()) {
      work->fail(ErrorCode::comm_failure, work->what() +
                                              " refused: the communicator is unusable "
                                              "after an earlier failure (" +
                                              poisoned_ + ")");
      work->settle();
      return work;
    }
    queue_.push_back({work, std::move(start), std::move(desc), std::move(keep)});
    queued_.store(true, std::memory_order_release);
    wake_.notify_one();
    return work;
  }

  // The communication thread: start queued collectives in order, test the ones in flight,
  // fail those past their deadline, and sleep only while nothing is in flight.
  void run() {
    std::vector<InFlight> inflight;
    std::chrono::steady_clock::time_point
        give_up{};  // when stopping: abandon timed-out requests then
    for (;;) {
      bool stopping;
      {
        std::lock_guard<std::mutex> lock(mu_);
        for (Pending& p : queue_) waiting_.push_back(std::move(p));
        queue_.clear();
        queued_.store(false, std::memory_order_relaxed);
        stopping = stop_;
      }
      bool progress = false;
      // Collectives start in submission order, at most kMaxInFlight at a time. In checking mode
      // a collective starts only after the previous one passed its check, so every rank issues
      // the same MPI calls in order.
      while (!waiting_.empty() && live(inflight) < kMaxInFlight &&
             !(check_ && checking(inflight))) {
        start_one(waiting_.front(), inflight);
        waiting_.pop_front();
        progress = true;
      }
      progress |= test_inflight(inflight);
      probe_->serve();
      if (stopping) {
        // Requests that timed out may still complete when a late peer arrives; give them a
        // grace period, then leave them to the process's end.
        bool only_abandoned = true;
        for (InFlight& f : inflight) only_abandoned &= f.timed_out;
        auto now = std::chrono::steady_clock::now();
        if (give_up == std::chrono::steady_clock::time_point{})
          give_up = now + std::chrono::seconds(2);
        if (waiting_.empty() && (inflight.empty() || (only_abandoned && now > give_up))) {
          abandoned_ = int(inflight.size());
          // MPI may still read an abandoned all_to_all's counts, or write a check's descriptors.
          for (InFlight& f : inflight) {
            if (f.keep) keep_until_exit(std::move(f.keep));
            if (!f.descs.empty())
              keep_until_exit(std::make_shared<std::vector<char>>(std::move(f.descs)));
          }
          return;
        }
      }
      if (inflight.empty() && waiting_.empty() && !stopping) {
        // Idle: the next collective usually follows within microseconds (a step's reductions
        // come in bursts), so spin briefly, then block until submit() or the end notifies.
        const auto spin_until = std::chrono::steady_clock::now() + std::chrono::microseconds(50);
        while (!queued_.load(std::memory_order_acquire) &&
               std::chrono::steady_clock::now() < spin_until)
          std::this_thread::yield();
        // Wakes every 20 ms meanwhile to answer peers' liveness probes (PeerProbe).
        std::unique_lock<std::mutex> lock(mu_);
        wake_.wait_for(lock, std::chrono::milliseconds(20),
                       [&] { return !queue_.empty() || stop_; });
      } else if (!progress) {
        // In flight: Open MPI advances non-blocking collectives only inside MPI calls, and a
        // large one needs a call per fragment, so keep testing without sleeping; yield so that
        // ranks sharing cores still run.
        std::this_thread::yield();
      }
    }
  }

  // Tests every collective in flight: completes the finished ones (starting a checked one's
  // collective once its descriptors are in) and fails those past their deadline. Returns
  // whether any made progress. Communication thread only.
  bool test_inflight(std::vector<InFlight>& inflight) {
    bool progress = false;
    for (size_t i = 0; i < inflight.size();) {
      InFlight& f = inflight[i];
      int flag = 0;
      try {
        ZS_MPI_CHECK_CTX(MPI_Test(&f.req, &flag, MPI_STATUS_IGNORE), f.work->what());
      } catch (const Error& e) {
        std::string msg = e.what();
        if (msg.find("MPI_ERR_TRUNCATE") != std::string::npos)
          msg +=
              " -- the ranks called different collectives here (at ZeRO stage 3, a module "
              "that runs on some ranks only gathers its unit on those ranks only: run it on "
              "every rank, e.g. with its output weighted by zero)";
        poison(msg);
        f.work->fail(e.code(), msg);
        flag = 1;
      }
      if (flag && f.start && !f.work->failed()) {
        // Descriptors gathered: start the collective itself if every rank called the same.
        progress = true;
        if (start_checked(f)) continue;
        flag = 1;
      }
      if (flag) {
        f.work->complete();
        inflight.erase(inflight.begin() + long(i));
        progress = true;
        continue;
      }
      const auto now = std::chrono::steady_clock::now();
      // In the last quarter of the time allowed, ask which peers still answer (a probe begun
      // before that quarter, for an earlier collective, does not count for this one).
      const auto probe_from = f.deadline - timeout_duration(timeout_s_.load() / 4);
      if (!f.timed_out && now > probe_from) probe_->start(probe_from);
      if (!f.timed_out && now > f.deadline) {
        // The request stays in flight: a late peer can still complete it, and MPI must keep
        // the buffers it was given. The caller learns now and the communicator refuses more.
        f.timed_out = true;
        const std::string silent = probe_->silent();
        if (!silent.empty()) peer_silent_ = true;
        std::string msg =
            f.work->what() + " did not complete within " + seconds_text(timeout_s_.load()) + " s" +
            (silent.empty()
                 ? " (every other rank still answers: a peer is late, "
                   "or called a different collective)"
                 : ": no answer from " + silent + ", dead, stopped, or cut off from this host");
        poison(msg);
        f.work->fail(ErrorCode::timeout, msg);
      }
      ++i;
    }
    return progress;
  }

  // At most this many collectives run at once; the others wait their turn, their timeout not yet
  // running. Open MPI's non-blocking collectives progress together inside each MPI_Test, and
  // many at once thrash the caches: 16 reduce-scatters of 4 MiB per rank (2 ranks, fresh
  // buffers, as stages 0-1 reduce every unit's gradients) took 7.0 ms per call started all at
  // once, 5.0 ms four at a time, 3.7 ms two or one at a time (as one alone on a fresh buffer);
  // at 256 KiB 0.30, 0.26, 0.14 and 0.20 ms (`zeroshard calibrate`, collectives.*.queued, on
  // the 2-core Intel machine of benchmarks/RESULTS.md). Two keep the next one's start off the
  // critical path. A call's timeout runs from its start: behind peers that are slow but answer,
  // the last of N queued calls may end up to N / 2 timeouts after it was submitted; behind a
  // peer that is gone, the first timeout refuses every call queued after it.
  static constexpr size_t kMaxInFlight = 2;
  // Collectives in flight that count against kMaxInFlight: a timed-out one stays in flight (a
  // late peer may complete it) but no longer holds back those behind it, which are then
  // refused.
  static size_t live(const std::vector<InFlight>& inflight) {
    size_t n = 0;
    for (const InFlight& f : inflight) n += f.timed_out ? 0 : 1;
    return n;
  }

  // A check in flight holds back the next collective, unless it timed out: then the next is
  // refused (the communicator is poisoned) rather than left waiting for it forever.
  static bool checking(const std::vector<InFlight>& inflight) {
    for (const InFlight& f : inflight)
      if (f.start && !f.timed_out) return true;
    return false;
  }

  // After the descriptor all-gather: compare, then start the real collective in the same slot.
  // Returns false when the call was refused (the Work has failed).
  bool start_checked(InFlight& f) {
    const char* mine = f.descs.data() + size_t(rank_) * kDescBytes;
    for (int q = 0; q < size_; ++q) {
      const char* theirs = f.descs.data() + size_t(q) * kDescBytes;
      if (std::strncmp(mine, theirs, kDescBytes) != 0) {
        std::string msg = "collective mismatch: rank " + std::to_string(rank_) + " called " +
                          std::string(mine, strnlen(mine, kDescBytes)) + " while rank " +
                          std::to_string(q) + " called " +
                          std::string(theirs, strnlen(theirs, kDescBytes));
        poison(msg);
        f.work->fail(ErrorCode::comm_failure, msg);
        f.start = nullptr;
        return false;
      }
    }
    Start start = std::move(f.start);
    f.start = nullptr;
    f.descs.clear();
    if (!started(f.work, [&] { ZS_MPI_CHECK_CTX(start(&f.req), f.work->what()); })) return false;
    f.deadline = deadline_from_now();
    return true;
  }

  std::chrono::steady_clock::time_point deadline_from_now() const {
    return std::chrono::steady_clock::now() + timeout_duration(timeout_s_.load());
  }

  void start_one(Pending& p, std::vector<InFlight>& inflight) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!poisoned_.empty()) {
        p.work->fail(ErrorCode::comm_failure,
                     p.work->what() +
                         " refused: the communicator is unusable after an earlier "
                         "failure (" +
                         poisoned_ + ")");
        p.work->settle();
        return;
      }
    }
    MPI_Request req = MPI_REQUEST_NULL;
    p.work->mark_started();
    if (check_) {
      // Checking mode: first all-gather what every rank is calling (a fixed-size exchange that
      // matches on every rank whatever they called), then the collective itself.
      InFlight f{p.work,
                 MPI_REQUEST_NULL,
                 deadline_from_now(),
                 false,
                 std::move(p.start),
                 std::vector<char>(size_t(size_ + 1) * kDescBytes, '\0'),
                 std::move(p.keep)};
      char* own = f.descs.data() + size_t(size_) * kDescBytes;
      std::strncpy(own, p.desc.c_str(), kDescBytes - 1);
      if (!started(p.work, [&] {
            ZS_MPI_CHECK_CTX(MPI_Iallgather(own, kDescBytes, MPI_CHAR, f.descs.data(), kDescBytes,
                                            MPI_CHAR, comm_, &f.req),
                             p.work->what() << " (its check)");
          })) {
        p.work->settle();
        return;
      }
      inflight.push_back(std::move(f));
      return;
    }
    if (!started(p.work, [&] { ZS_MPI_CHECK_CTX(p.start(&req), p.work->what()); })) {
      p.work->settle();
      return;
    }
    inflight.push_back({p.work, req, deadline_from_now(), false, nullptr, {}, std::move(p.keep)});
  }

  // Runs `start`, which starts an MPI call through ZS_MPI_CHECK_CTX. On the communication
  // thread a failure fails the collective's Work instead of propagating: returns false then.
  template <class F>
  static bool started(const std::shared_ptr<WorkState>& work, F&& start) {
    try {
      start();
      return true;
    } catch (const Error& e) {
      work->fail(e.code(), std::string(e.what()) + " (could not start)");
      return false;
    }
  }

  void poison(const std::string& why) {
    std::lock_guard<std::mutex> lock(mu_);
    if (poisoned_.empty()) poisoned_ = why;
  }

  std::shared_ptr<MpiRuntime> rt_;
  MPI_Comm comm_ = MPI_COMM_NULL;
  int rank_ = 0, size_ = 1;
  std::atomic<double> timeout_s_{300.0};
  std::mutex mu_;
  std::condition_variable wake_;     // submit() and the destructor wake an idle comm thread
  std::atomic<bool> queued_{false};  // queue_ is non-empty (read without the lock while spinning)
  std::deque<Pending> queue_;
  std::deque<Pending> waiting_;  // comm thread only: taken from queue_, not started yet
  // ZEROSHARD_CHECK_COLLECTIVES=1: every collective first checks that all ranks call the same.
  const bool check_ = [] {
    const char* v = std::getenv("ZEROSHARD_CHECK_COLLECTIVES");
    return v && *v && std::string(v) != "0";
  }();
  bool stop_ = false;
  std::string poisoned_;
  int abandoned_ = 0;
  bool peer_silent_ = false;          // a timeout found peers that no longer answer (comm thread)
  bool closed_ = false;               // close() ran (the destructor or finalize_mpi())
  std::unique_ptr<PeerProbe> probe_;  // comm thread only, once open() made it
  std::thread thread_;
};

}  // namespace

void finalize_mpi() {
  int inited = 0;
  MPI_Initialized(&inited);
  if (inited) MpiRuntime::get()->finalize();
}

void abort_mpi_job(int code) {
  int inited = 0, finalized = 0, size = 1;
  MPI_Initialized(&inited);
  MPI_Finalized(&finalized);
  if (!inited || finalized) return;
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  if (size <= 1) return;
  std::fflush(stdout);
  std::fflush(stderr);
  MPI_Abort(MPI_COMM_WORLD, code);
}

std::shared_ptr<Communicator> make_mpi_communicator() {
  auto comm = std::make_shared<MpiCommunicator>();
  // A launcher that announced another world size started the processes with another MPI
  // library's runtime: each then sees a world of its own.
  const LaunchInfo li = launch_info();
  if ((li.launcher == "mpirun" || li.launcher == "srun") && comm->size() != li.world_size)
    ZS_THROW(comm_failure, "MPI reports " << comm->size() << " ranks but " << li.launcher
                                          << " started " << li.world_size
                                          << ": the MPI library zeroshard was built with is not "
                                             "the one of the launcher that started this process");
  return comm;
}

}  // namespace zeroshard
