// The same-bytes memory kernel (zeroshard::cpu::same_bytes) for Python: the memory ceiling that
// benchmarks put an optimizer step against (docs/DESIGN.md rule 9), and a calibration point for a
// capacity planner. It moves exactly the streams it is given, with no arithmetic, split and
// scheduled as the engine splits its CPU update: Arena::kChunk (64 Ki) elements per task on a
// oneTBB arena, with the ISA cpu::best_isa() picks (ZEROSHARD_CPU_ISA caps it).
//
//   k = zeroshard._core.SameBytes(threads=2)
//   seconds = k.run(reads=[p, m, v, g], writes=[p, m, v])     # AdamW's f32 streams, in place
//   seconds = zeroshard._core.same_bytes(reads, writes, threads=2)   # one-off, same thing
//
// Streams are contiguous CPU tensors or arrays with one element count n between them (one
// element per parameter), of dtypes of 2, 4 or 8 bytes: an update's bf16 gradient and its bf16
// copy-out sit next to its f32 master and moments. Chunk [b, e) of the n elements moves elements
// [b, e) of every stream, so all streams advance together as in the update; a stream of w-byte
// elements is moved as 4-byte words [b·w/4, e·w/4), rounded down at the end of the stream (an odd
// bf16 tail of 2 bytes is not moved). The kernel xors the words read and writes the result to every
// write stream: what a write stream held is lost, so pass buffers that belong to nobody else. The
// same tensor in both lists is an in-place stream, as the update's master and moments are.
//
// The pass itself is the library's zeroshard::SameBytesPass (zeroshard/calibration.hpp).
//
// Also the 8-bit blockwise quantization of the q8 optimizer state (zeroshard/quantize.hpp), on
// arrays the caller allocates:
//   zeroshard._core.quantize_8bit(x_f32, codes_u8, absmax_f32, block, signed)
//   zeroshard._core.dequantize_8bit(codes_u8, absmax_f32, x_f32, block, signed)
//   zeroshard._core.code_points_8bit(signed)               # the 256 codes' points
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "python_bindings/src/bindings.hpp"
#include "zeroshard/calibration.hpp"
#include "zeroshard/quantize.hpp"

namespace zeroshard::py {

namespace {

// One stream as the kernel sees it: 4-byte words, and how many bytes one element takes.
struct Stream {
  Imported keep;  // holds the producer's memory for the duration of the call
  char* data = nullptr;
  int64_t width = 0;  // bytes per element
};

// Imports the streams, checks they share one element count, and returns that count.
int64_t import_streams(nb::handle list, bool writable, const char* which, int64_t n,
                       std::vector<Stream>& out) {
  for (nb::handle h : list) {
    const std::string what =
        std::string("same_bytes(): ") + which + " stream " + std::to_string(out.size());
    TensorRequest req{what, /*any_dtype=*/true};
    Stream s;
    s.keep = import_tensor(h, req, writable);
    const int64_t numel = s.keep.view.numel;
    if (n >= 0 && numel != n)
      throw Error(ErrorCode::invalid_argument, what + " has " + std::to_string(numel) +
                                                   " elements; the streams before it have " +
                                                   std::to_string(n) + " (one per parameter)");
    n = numel;
    s.data = static_cast<char*>(s.keep.view.data);
    s.width = numel > 0 ? s.keep.nbytes / numel : 4;
    out.push_back(std::move(s));
  }
  return n;
}

class SameBytes {
 public:
  explicit SameBytes(int threads) : pass_(threads) {}
  int threads() const { return pass_.threads(); }
  const char* isa() const { return pass_.isa(); }

  // One pass over the streams; returns its wall time in seconds (the imports and checks before
  // it are not counted).
  double run(nb::handle reads, nb::handle writes) {
    std::vector<Stream> rd, wr;
    int64_t n = import_streams(reads, false, "read", -1, rd);
    n = import_streams(writes, true, "write", n, wr);
    if (n < 0) throw Error(ErrorCode::invalid_argument, "same_bytes(): no streams given");
    std::vector<MemoryStream> r, w;
    for (Stream& s : rd) r.push_back({s.data, int(s.width)});
    for (Stream& s : wr) w.push_back({s.data, int(s.width)});
    nb::gil_scoped_release nogil;
    return pass_.run(r, w, n);
  }

 private:
  SameBytesPass pass_;
};

// An array of `numel` elements of `width` bytes each (numel < 0: any count), for the 8-bit calls.
Imported import_elements(nb::handle h, const std::string& what, int width, int64_t numel,
                         bool writable) {
  Imported t = import_tensor(h, TensorRequest{what, /*any_dtype=*/true}, writable);
  if (t.nbytes != t.view.numel * width)
    throw Error(ErrorCode::invalid_argument, what + " must have " + std::to_string(width) +
                                                 "-byte elements (" +
                                                 (width == 1 ? "uint8" : "float32") + ")");
  if (numel >= 0 && t.view.numel != numel)
    throw Error(ErrorCode::invalid_argument, what + " has " + std::to_string(t.view.numel) +
                                                 " elements, not " + std::to_string(numel));
  return t;
}

int64_t blocks_of(int64_t n, int64_t block) {
  if (block < 1)
    throw Error(ErrorCode::invalid_argument,
                "block must be at least 1, got " + std::to_string(block));
  return (n + block - 1) / block;
}

void quantize(nb::handle x, nb::handle codes, nb::handle absmax, int64_t block, bool is_signed) {
  const Imported xi = import_elements(x, "quantize_8bit(): x", 4, -1, false);
  const int64_t n = xi.view.numel;
  Imported q = import_elements(codes, "quantize_8bit(): codes", 1, n, true);
  Imported a = import_elements(absmax, "quantize_8bit(): absmax", 4, blocks_of(n, block), true);
  quantize_8bit(static_cast<const float*>(xi.view.data), n, block, is_signed,
                static_cast<uint8_t*>(q.view.data), static_cast<float*>(a.view.data));
}

void dequantize(nb::handle codes, nb::handle absmax, nb::handle x, int64_t block, bool is_signed) {
  const Imported q = import_elements(codes, "dequantize_8bit(): codes", 1, -1, false);
  const int64_t n = q.view.numel;
  const Imported a =
      import_elements(absmax, "dequantize_8bit(): absmax", 4, blocks_of(n, block), false);
  Imported xi = import_elements(x, "dequantize_8bit(): x", 4, n, true);
  dequantize_8bit(static_cast<const uint8_t*>(q.view.data), static_cast<const float*>(a.view.data),
                  n, block, is_signed, static_cast<float*>(xi.view.data));
}

}  // namespace

void bind_kernels(nb::module_& m) {
  nb::class_<SameBytes>(
      m, "SameBytes",
      "The same-bytes memory kernel on its own oneTBB arena: SameBytes(threads=0) (0: the "
      "engine's default, ZEROSHARD_CPU_THREADS or cores / local ranks). run(reads, writes) reads "
      "every read stream and writes every write stream once, with no arithmetic, in 64 Ki-element "
      "chunks as the engine's CPU update runs, and returns the pass's wall time in seconds. "
      "Streams: contiguous CPU tensors or arrays, one element count n between them, dtypes of 2, "
      "4 or 8 bytes (a w-byte stream moves n*w bytes, rounded down to 4); a tensor in both lists "
      "is an in-place stream. Write streams are overwritten with meaningless bits. At most 8 "
      "read and 8 write streams per element width, and a write stream of every width read.")
      .def(nb::init<int>(), nb::arg("threads") = 0)
      .def_prop_ro("threads", &SameBytes::threads, "Threads of the arena.")
      .def_prop_ro("isa", &SameBytes::isa, "The kernel's ISA: 'scalar', 'avx2' or 'avx512'.")
      .def("run", &SameBytes::run, nb::arg("reads"), nb::arg("writes"));
  m.def(
      "same_bytes",
      [](nb::handle reads, nb::handle writes, int threads) {
        SameBytes k(threads);
        return k.run(reads, writes);
      },
      nb::arg("reads"), nb::arg("writes"), nb::arg("threads") = 0,
      "One SameBytes(threads).run(reads, writes) on a new arena (its threads start inside the "
      "timed pass: keep a SameBytes to time repeated passes).");
  m.def(
      "code_points_8bit",
      [](bool is_signed) {
        const std::array<float, 256> c = code_points_8bit(is_signed);
        return std::vector<float>(c.begin(), c.end());
      },
      nb::arg("signed"),
      "The points of the 256 8-bit codes (in code order) that optimizer_state='8bit' uses.");
  m.def("quantize_8bit", &quantize, nb::arg("x"), nb::arg("codes"), nb::arg("absmax"),
        nb::arg("block"), nb::arg("signed"),
        "Blockwise 8-bit quantization as optimizer_state='8bit' stores moments: x (float32, n) "
        "into codes (uint8, n) and absmax (float32, ceil(n / block)), arrays the caller "
        "allocates. The code of the nearest point to x * (1 / absmax), absmax = max |x| per "
        "block.");
  m.def("dequantize_8bit", &dequantize, nb::arg("codes"), nb::arg("absmax"), nb::arg("x"),
        nb::arg("block"), nb::arg("signed"),
        "x[i] = point[codes[i]] * absmax[i // block] (x: float32, allocated by the caller).");
}

}  // namespace zeroshard::py
