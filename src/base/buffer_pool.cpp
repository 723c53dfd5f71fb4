#include "src/base/buffer_pool.hpp"

namespace zeroshard {

void BufferPool::fill(int count, const std::function<Buffer()>& make) {
  for (int i = 0; i < count; ++i) {
    buffers.push_back(make());
    owner.push_back(-1);
  }
}

int BufferPool::acquire(int unit) {
  for (size_t i = 0; i < owner.size(); ++i)
    if (owner[i] < 0) {
      owner[i] = unit;
      return int(i);
    }
  return -1;
}

}  // namespace zeroshard
