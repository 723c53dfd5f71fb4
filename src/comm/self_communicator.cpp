// The one-rank communicator: every collective is a copy (or nothing), done synchronously.
#include <cstring>
#include <memory>

#include "base/pieces.hpp"
#include "src/comm/split_check.hpp"
#include "src/comm/work_state.hpp"
#include "zeroshard/communicator.hpp"

namespace zeroshard {
namespace {

class SelfCommunicator final : public Communicator {
 public:
  int rank() const override { return 0; }
  int size() const override { return 1; }
  std::shared_ptr<Work> reduce_scatter(const void* send, void* recv, int64_t count, DType dtype,
                                       std::string what) override {
    if (send != recv) std::memmove(recv, send, size_t(count) * dtype_size(dtype));
    return done_work(std::move(what));
  }
  std::shared_ptr<Work> all_gather(const void* send, void* recv, int64_t count, DType dtype,
                                   std::string what) override {
    if (send != recv) std::memmove(recv, send, size_t(count) * dtype_size(dtype));
    return done_work(std::move(what));
  }
  std::shared_ptr<Work> all_reduce(double*, int64_t, ReduceOp, std::string what) override {
    return done_work(std::move(what));
  }
  std::shared_ptr<Work> all_reduce_sum(void*, int64_t, DType, std::string what) override {
    return done_work(std::move(what));
  }
  std::shared_ptr<Work> broadcast(void*, int64_t, int, std::string what) override {
    return done_work(std::move(what));
  }
  std::shared_ptr<Work> all_to_all(const void* send, const Pieces& sends, void* recv,
                                   const Pieces& recvs, DType dtype, std::string what) override {
    check_pieces(sends, 0, 1, what, "send");
    check_pieces(recvs, 0, 1, what, "recv");
    if (sends.counts[0] != recvs.counts[0])
      ZS_THROW(invalid_argument, "rank 0: all_to_all of " << what << ": sends " << sends.counts[0]
                                                          << " elements to itself but receives "
                                                          << recvs.counts[0]);
    const size_t es = dtype_size(dtype);
    if (sends.counts[0] > 0)
      std::memmove(static_cast<char*>(recv) + size_t(recvs.offsets[0]) * es,
                   static_cast<const char*>(send) + size_t(sends.offsets[0]) * es,
                   size_t(sends.counts[0]) * es);
    return done_work(std::move(what));
  }
  void barrier(std::string) override {}
  std::shared_ptr<Communicator> split(const std::vector<int>& ranks, std::string what) override {
    check_split(ranks, 0, 1, what);
    return std::make_shared<SelfCommunicator>();
  }
  void set_timeout(double) override {}
};

}  // namespace

std::shared_ptr<Communicator> make_self_communicator() {
  return std::make_shared<SelfCommunicator>();
}

}  // namespace zeroshard
