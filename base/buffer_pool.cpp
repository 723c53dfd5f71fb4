#include "base/buffer_pool.hpp"

namespace zeroshard {

void BufferPool::fill(int count, const std::function<Buffer()>& make) {
  for (int i = 0; i < count; ++i) {
    buffers.push_back(make());
    owner.push_back(-1);
  }
}

int BufferPool::acquire(int unit, size_t bytes) {
  int best = -1;
  for (size_t i = 0; i < owner.size(); ++i)
    if (owner[i] < 0 && buffers[i].bytes() >= bytes &&
        (best < 0 || buffers[i].bytes() < buffers[size_t(best)].bytes()))
      best = int(i);
  if (best >= 0) owner[size_t(best)] = unit;
  return best;
}

}  // namespace zeroshard
