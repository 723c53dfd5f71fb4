// The store communicator: collectives through a key-value store every rank reaches (torchrun's
// TCPStore), for set-up where no MPI launcher started the ranks. Each collective is one round:
// every rank publishes its input under (round, rank) and reads every other rank's, then computes
// the result itself, in rank order, so every rank gets the same bits. A rank erases its key of
// round k once round k + 1 is complete: by then every rank has published k + 1, so every rank
// has finished reading k.

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "base/check.hpp"
#include "base/pieces.hpp"
#include "kernels/cpu/cpu_kernels.hpp"
#include "src/comm/seconds_text.hpp"
#include "src/comm/split_check.hpp"
#include "src/comm/work_state.hpp"
#include "zeroshard/communicator.hpp"

namespace zeroshard {
namespace {

std::string to_hex(const void* data, size_t bytes) {
  static const char digits[] = "0123456789abcdef";
  const auto* p = static_cast<const unsigned char*>(data);
  std::string s(bytes * 2, '0');
  for (size_t i = 0; i < bytes; ++i) {
    s[2 * i] = digits[p[i] >> 4];
    s[2 * i + 1] = digits[p[i] & 15];
  }
  return s;
}

// Decodes `hex` into `out` (bytes long); false if it is not that many bytes of hex.
bool from_hex(std::string_view hex, void* out, size_t bytes) {
  if (hex.size() != bytes * 2) return false;
  auto* p = static_cast<unsigned char*>(out);
  for (size_t i = 0; i < bytes; ++i) {
    int v = 0;
    for (int k = 0; k < 2; ++k) {
      const char c = hex[2 * i + size_t(k)];
      const int d = c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1;
      if (d < 0) return false;
      v = v * 16 + d;
    }
    p[i] = static_cast<unsigned char>(v);
  }
  return true;
}

class StoreCommunicator final : public Communicator {
 public:
  // `ranks`: the store ranks of this communicator's members, in rank order.
  StoreCommunicator(KeyValueStore store, std::string prefix, std::vector<int> ranks, int rank,
                    double timeout_s)
      : store_(std::move(store)),
        prefix_(std::move(prefix)),
        ranks_(std::move(ranks)),
        rank_(rank),
        timeout_s_(timeout_s) {}

  int rank() const override { return rank_; }
  int size() const override { return int(ranks_.size()); }

  std::shared_ptr<Work> reduce_scatter(const void* send, void* recv, int64_t recv_count,
                                       DType dtype, std::string what) override {
    const size_t block = size_t(recv_count) * dtype_size(dtype);
    auto all = exchange(to_hex(send, block * ranks_.size()), what);
    require_bytes(all, block * ranks_.size(), what);
    std::vector<unsigned char> acc(block), in(block);
    for (size_t r = 0; r < all.size(); ++r) {
      from_hex(std::string_view(all[r]).substr(size_t(rank_) * block * 2, block * 2),
               r == 0 ? acc.data() : in.data(), block);
      if (r > 0) cpu::add_into(cpu::best_isa(), acc.data(), in.data(), dtype, recv_count);
    }
    std::memcpy(recv, acc.data(), block);
    return done_work(std::move(what));
  }

  std::shared_ptr<Work> all_gather(const void* send, void* recv, int64_t send_count, DType dtype,
                                   std::string what) override {
    const size_t block = size_t(send_count) * dtype_size(dtype);
    auto all = exchange(to_hex(send, block), what);
    require_bytes(all, block, what);
    for (size_t r = 0; r < all.size(); ++r)
      from_hex(all[r], static_cast<char*>(recv) + r * block, block);
    return done_work(std::move(what));
  }

  std::shared_ptr<Work> all_reduce(double* inout, int64_t count, ReduceOp op,
                                   std::string what) override {
    const size_t bytes = size_t(count) * sizeof(double);
    auto all = exchange(to_hex(inout, bytes), what);
    require_bytes(all, bytes, what);
    std::vector<double> in(static_cast<size_t>(count));
    for (size_t r = 0; r < all.size(); ++r) {
      from_hex(all[r], in.data(), bytes);
      for (size_t i = 0; i < in.size(); ++i) {
        double& a = inout[i];
        const double b = in[i];
        if (r == 0)
          a = b;
        else if (op == ReduceOp::sum)
          a += b;
        else
          a = op == ReduceOp::max ? std::max(a, b) : std::min(a, b);
      }
    }
    return done_work(std::move(what));
  }

  std::shared_ptr<Work> all_reduce_sum(void* inout, int64_t count, DType dtype,
                                       std::string what) override {
    const size_t bytes = size_t(count) * dtype_size(dtype);
    auto all = exchange(to_hex(inout, bytes), what);
    require_bytes(all, bytes, what);
    std::vector<unsigned char> in(bytes);
    from_hex(all[0], inout, bytes);
    for (size_t r = 1; r < all.size(); ++r) {
      from_hex(all[r], in.data(), bytes);
      cpu::add_into(cpu::best_isa(), inout, in.data(), dtype, count);
    }
    return done_work(std::move(what));
  }

  std::shared_ptr<Work> broadcast(void* data, int64_t bytes, int root, std::string what) override {
    if (root < 0 || root >= size())
      ZS_THROW(invalid_argument, "rank " << rank_ << ": " << what << ": root " << root
                                         << " is not a rank of " << size());
    // Every rank publishes (the others an empty value), so that every round is complete.
    auto all = exchange(rank_ == root ? to_hex(data, size_t(bytes)) : std::string(), what);
    require_bytes(all, size_t(bytes), what, root);
    from_hex(all[size_t(root)], data, size_t(bytes));
    return done_work(std::move(what));
  }

  // One round: each rank publishes its send counts (int64 per rank) and then its pieces, in rank
  // order; each reads its own piece out of every other rank's value.
  std::shared_ptr<Work> all_to_all(const void* send, const Pieces& sends, void* recv,
                                   const Pieces& recvs, DType dtype, std::string what) override {
    check_pieces(sends, rank_, size(), what, "send");
    check_pieces(recvs, rank_, size(), what, "recv");
    const size_t es = dtype_size(dtype), head = size_t(size()) * sizeof(int64_t);
    std::string mine = to_hex(sends.counts.data(), head);
    for (int q = 0; q < size(); ++q)
      mine += to_hex(static_cast<const char*>(send) + size_t(sends.offsets[size_t(q)]) * es,
                     size_t(sends.counts[size_t(q)]) * es);
    const auto all = exchange(std::move(mine), what);
    for (int r = 0; r < size(); ++r) {
      const std::string_view v = all[size_t(r)];
      std::vector<int64_t> counts(static_cast<size_t>(size()));
      int64_t before = 0;
      bool ok = v.size() >= head * 2 && from_hex(v.substr(0, head * 2), counts.data(), head);
      for (int q = 0; ok && q < rank_; ++q) before += counts[size_t(q)];
      const size_t n = size_t(recvs.counts[size_t(r)]) * es;
      ok = ok && counts[size_t(rank_)] == recvs.counts[size_t(r)] &&
           from_hex(v.substr(std::min(v.size(), (head + size_t(before) * es) * 2), n * 2),
                    static_cast<char*>(recv) + size_t(recvs.offsets[size_t(r)]) * es, n);
      if (!ok) {
        std::lock_guard<std::mutex> lock(mu_);
        fail(ErrorCode::comm_failure, what,
             "rank " + std::to_string(r) + " did not send the " +
                 std::to_string(recvs.counts[size_t(r)]) +
                 " elements this rank expects (the ranks called different collectives, or "
                 "disagree on the pieces)");
      }
    }
    return done_work(std::move(what));
  }

  void barrier(std::string what) override { require_bytes(exchange(std::string(), what), 0, what); }

  std::shared_ptr<Communicator> split(const std::vector<int>& ranks, std::string what) override {
    check_split(ranks, rank_, size(), what);
    // Every rank splits in the same place of its sequence, so the count names the split alike
    // everywhere; the members' ranks name the group.
    barrier(what);
    const uint64_t index = splits_++;
    std::vector<int> members;
    std::string name;
    for (int r : ranks) {
      members.push_back(ranks_[size_t(r)]);
      name += "." + std::to_string(r);
    }
    const int me = int(std::find(ranks.begin(), ranks.end(), rank_) - ranks.begin());
    return std::make_shared<StoreCommunicator>(
        store_, prefix_ + "/split" + std::to_string(index) + name, members, me, timeout_s_);
  }

  void set_timeout(double seconds) override { timeout_s_ = seconds; }

 private:
  std::string key(uint64_t round, int rank) const {
    return prefix_ + "/" + std::to_string(round) + "/" + std::to_string(rank);
  }

  // One round: publishes `mine`, returns every rank's value.
  std::vector<std::string> exchange(std::string mine, const std::string& what) {
    std::lock_guard<std::mutex> lock(mu_);
    if (broken_)
      ZS_THROW(comm_failure, "rank " << rank_ << ": " << what
                                     << ": the store communicator failed before (" << broken_why_
                                     << ")");
    const uint64_t round = round_++;
    try {
      store_.set(key(round, rank_), mine);
    } catch (const std::exception& e) {
      fail(ErrorCode::comm_failure, what,
           std::string("publishing to the store failed: ") + e.what());
    }
    std::vector<std::string> all(ranks_.size());
    all[size_t(rank_)] = std::move(mine);
    const auto start = std::chrono::steady_clock::now();
    auto pause = std::chrono::microseconds(200);
    for (int r = 0; r < size(); ++r) {
      if (r == rank_) continue;
      for (;;) {
        std::optional<std::string> v;
        try {
          v = store_.try_get(key(round, r));
        } catch (const std::exception& e) {
          fail(ErrorCode::comm_failure, what,
               "reading rank " + std::to_string(r) + "'s value failed: " + e.what());
        }
        if (v) {
          all[size_t(r)] = std::move(*v);
          break;
        }
        const double waited =
            std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
        if (waited > timeout_s_)
          fail(ErrorCode::timeout, what,
               "rank " + std::to_string(r) + " (of the store's rank " +
                   std::to_string(ranks_[size_t(r)]) + ") did not publish within " +
                   seconds_text(timeout_s_) + " s: it is late, dead, or in another collective");
        std::this_thread::sleep_for(pause);
        pause = std::min(pause * 2, std::chrono::microseconds(50000));
      }
    }
    if (round > 0 && store_.erase) {
      try {
        store_.erase(key(round - 1, rank_));
      } catch (const std::exception&) {
        // A key left behind costs the store a few bytes; the collective itself succeeded.
      }
    }
    return all;
  }

  // Every value (or only rank `only`'s) must be `bytes` bytes in hex.
  void require_bytes(const std::vector<std::string>& all, size_t bytes, const std::string& what,
                     int only = -1) {
    for (int r = 0; r < size(); ++r)
      if ((only < 0 || r == only) && all[size_t(r)].size() != bytes * 2) {
        std::lock_guard<std::mutex> lock(mu_);
        fail(ErrorCode::comm_failure, what,
             "rank " + std::to_string(r) + " published " +
                 std::to_string(all[size_t(r)].size() / 2) + " bytes where this rank expects " +
                 std::to_string(bytes) + " (the ranks called different collectives)");
      }
  }

  [[noreturn]] void fail(ErrorCode code, const std::string& what, const std::string& why) {
    broken_ = true;
    broken_why_ = what + ": " + why;
    throw Error(code, "rank " + std::to_string(rank_) + ": " + what + ": " + why);
  }

  std::mutex mu_;  // one round at a time, whichever thread calls
  KeyValueStore store_;
  std::string prefix_;
  std::vector<int> ranks_;
  int rank_;
  double timeout_s_;
  uint64_t round_ = 0;
  std::atomic<uint64_t> splits_{0};  // split() is collective: every rank counts alike
  bool broken_ = false;
  std::string broken_why_;
};

}  // namespace

std::shared_ptr<Communicator> make_store_communicator(KeyValueStore store, int rank, int size,
                                                      std::string prefix) {
  if (!store.set || !store.try_get)
    ZS_THROW(invalid_argument, "make_store_communicator: the store needs set and try_get");
  if (size < 1 || rank < 0 || rank >= size)
    ZS_THROW(invalid_argument,
             "make_store_communicator: rank " << rank << " is not a rank of " << size);
  std::vector<int> ranks(static_cast<size_t>(size));
  for (int r = 0; r < size; ++r) ranks[size_t(r)] = r;
  return std::make_shared<StoreCommunicator>(std::move(store), std::move(prefix), std::move(ranks),
                                             rank, 300.0);
}

}  // namespace zeroshard
