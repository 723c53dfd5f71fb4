#pragma once
// Communicator::all_to_all() against its definition, for any communicator and world size (the
// store communicator's unit test and the multi-rank suite's MPI and one-rank cases share it).
// Rank p sends rank q (p·7 + q·3) mod 5 elements, zero for some pairs; its pieces lie in its
// send buffer in reverse rank order with gaps, and land in the receiver's in rank order with
// gaps, which must keep their contents. Values are small integers, exact in f32 and bf16.

#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include "zeroshard/communicator.hpp"

namespace zs_test {

inline int64_t pair_count(int from, int to) {
  return (int64_t(from) * 7 + int64_t(to) * 3) % 5;
}

inline float pair_value(int from, int to, int64_t i) {
  return float(from * 32 + to * 8 + int(i));
}

// Element i of a buffer of f32 or bf16 (the upper half of an f32's bits: exact for these).
inline void put(std::vector<char>& buf, zeroshard::DType dt, int64_t i, float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, 4);
  if (dt == zeroshard::DType::f32)
    std::memcpy(buf.data() + i * 4, &v, 4);
  else {
    const uint16_t h = uint16_t(bits >> 16);
    std::memcpy(buf.data() + i * 2, &h, 2);
  }
}
inline float get(const std::vector<char>& buf, zeroshard::DType dt, int64_t i) {
  float v;
  if (dt == zeroshard::DType::f32) {
    std::memcpy(&v, buf.data() + i * 4, 4);
    return v;
  }
  uint16_t h;
  std::memcpy(&h, buf.data() + i * 2, 2);
  const uint32_t bits = uint32_t(h) << 16;
  std::memcpy(&v, &bits, 4);
  return v;
}

inline void check_all_to_all(zeroshard::Communicator& c) {
  const int n = c.size(), r = c.rank();
  for (zeroshard::DType dt : {zeroshard::DType::f32, zeroshard::DType::bf16}) {
    const size_t es = zeroshard::dtype_size(dt);
    zeroshard::Pieces sends{std::vector<int64_t>(size_t(n)), std::vector<int64_t>(size_t(n))};
    zeroshard::Pieces recvs = sends;
    int64_t at = 1;
    for (int q = n - 1; q >= 0; --q) {  // reverse order, a gap of 2 before each piece
      sends.counts[size_t(q)] = pair_count(r, q);
      sends.offsets[size_t(q)] = at;
      at += pair_count(r, q) + 2;
    }
    std::vector<char> send(size_t(at) * es);
    for (int q = 0; q < n; ++q)
      for (int64_t i = 0; i < pair_count(r, q); ++i)
        put(send, dt, sends.offsets[size_t(q)] + i, pair_value(r, q, i));
    at = 0;
    for (int q = 0; q < n; ++q) {  // rank order, a gap of 1 after each piece
      recvs.counts[size_t(q)] = pair_count(q, r);
      recvs.offsets[size_t(q)] = at;
      at += pair_count(q, r) + 1;
    }
    std::vector<char> recv(size_t(at) * es);
    for (int64_t i = 0; i < at; ++i) put(recv, dt, i, -1.0f);
    c.all_to_all(send.data(), sends, recv.data(), recvs, dt, "test pieces")->wait();
    std::vector<bool> piece(size_t(at), false);
    for (int q = 0; q < n; ++q)
      for (int64_t i = 0; i < pair_count(q, r); ++i) {
        const int64_t k = recvs.offsets[size_t(q)] + i;
        piece[size_t(k)] = true;
        ASSERT_EQ(get(recv, dt, k), pair_value(q, r, i))
            << zeroshard::dtype_name(dt) << ": rank " << r << " from " << q << ", element " << i;
      }
    for (int64_t k = 0; k < at; ++k)
      if (!piece[size_t(k)]) {
        ASSERT_EQ(get(recv, dt, k), -1.0f) << "gap " << k << " was written";
      }
  }
  // Nothing to move anywhere is still a collective every rank completes.
  const zeroshard::Pieces none{std::vector<int64_t>(size_t(n), 0),
                               std::vector<int64_t>(size_t(n), 0)};
  c.all_to_all(nullptr, none, nullptr, none, zeroshard::DType::f32, "nothing")->wait();
}

}  // namespace zs_test
