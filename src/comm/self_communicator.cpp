// The one-rank communicator: every collective is a copy (or nothing), done synchronously.
#include <cstring>
#include <memory>

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
