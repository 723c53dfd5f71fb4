#pragma once
// in_threads(n, f): f(t) for every t in [0, n), each in a thread of its own; once all have
// ended, rethrows the first error any of them threw.
#include <cstddef>
#include <exception>
#include <thread>
#include <vector>

namespace zeroshard {

template <class F>
void in_threads(size_t n, F&& f) {
  std::vector<std::exception_ptr> errors(n);
  std::vector<std::thread> threads;
  try {
    for (size_t t = 0; t < n; ++t)
      threads.emplace_back([&, t] {
        try {
          f(t);
        } catch (...) {
          errors[t] = std::current_exception();
        }
      });
  } catch (...) {  // a thread that could not start: the others end first
    for (std::thread& t : threads) t.join();
    throw;
  }
  for (std::thread& t : threads) t.join();
  for (const std::exception_ptr& e : errors)
    if (e) std::rethrow_exception(e);
}

}  // namespace zeroshard
