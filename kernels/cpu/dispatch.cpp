// Run-time ISA selection and argument checks for the CPU kernels. This file is compiled without
// any -m flag, so everything here runs on any x86-64 CPU; ISA-specific code is reached only
// through a KernelTable after isa_supported() said yes.

#include <cpuid.h>

#include <cstdlib>
#include <string_view>

#include "base/check.hpp"
#include "kernels/cpu/cpu_kernels.hpp"
#include "kernels/cpu/kernel_table.hpp"
#include "kernels/cpu/scalar_convert.hpp"

namespace zeroshard::cpu {
namespace {

// DType reaches here as a raw byte from bindings and config code; an out-of-range value must be
// refused, since the templates' dtype switch would otherwise silently do nothing.
bool valid_dtype(DType d) {
  return d == DType::f32 || d == DType::bf16 || d == DType::f16;
}

// F16C straight from CPUID leaf 1 (ECX bit 29): clang's __builtin_cpu_supports does not know
// the "f16c" name. The OS-saves-YMM check is part of the avx2 test it is always paired with.
bool has_f16c() {
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  return __get_cpuid(1, &eax, &ebx, &ecx, &edx) != 0 && (ecx & bit_F16C) != 0;
}

bool detect(Isa isa) {
  switch (isa) {
    case Isa::scalar:
      return true;
    case Isa::avx2:
      return __builtin_cpu_supports("avx2") && has_f16c();
    case Isa::avx512:
      // avx2 + f16c too: the AVX-512 file is compiled with them and may use them anywhere.
      return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx2") && has_f16c();
  }
  return false;
}

constexpr int kIsaCount = 3;

// CPUID is read once per process; every kernel call then checks a plain bool.
struct IsaSupport {
  bool supported[kIsaCount];
  IsaSupport() {
    __builtin_cpu_init();  // needed when called before libgcc's own constructor has run
    for (int i = 0; i < kIsaCount; ++i) supported[i] = detect(static_cast<Isa>(i));
  }
};

const IsaSupport& support() {
  static const IsaSupport s;
  return s;
}

// ZEROSHARD_CPU_ISA lets a user pin a narrower ISA (to compare variants, or to dodge AVX-512
// frequency drops on older parts); an unknown value is an error rather than a silent default.
Isa parse_isa_env() {
  Isa best = Isa::scalar;
  for (Isa isa : {Isa::avx2, Isa::avx512}) {
    if (isa_supported(isa)) best = isa;
  }
  const char* env = std::getenv("ZEROSHARD_CPU_ISA");
  if (env == nullptr || *env == '\0') return best;
  const std::string_view want(env);
  for (Isa isa : {Isa::scalar, Isa::avx2, Isa::avx512}) {
    // A cap, not a demand: asking for avx512 on an AVX2 machine still gets AVX2.
    if (want == isa_name(isa)) return static_cast<int>(isa) < static_cast<int>(best) ? isa : best;
  }
  ZS_THROW(invalid_config, "ZEROSHARD_CPU_ISA='" << want << "' is not one of scalar, avx2, avx512");
}

// An ISA the CPU lacks is refused here: entering avx512.cpp on such a CPU would be SIGILL, not an
// error a caller could catch.
const KernelTable& table(Isa isa) {
  if (!isa_supported(isa)) {
    ZS_THROW(invalid_argument,
             "CPU kernels: ISA " << isa_name(isa) << " is not supported by this CPU");
  }
  switch (isa) {
    case Isa::avx2:
      return avx2_kernels();
    case Isa::avx512:
      return avx512_kernels();
    case Isa::scalar:
      break;
  }
  return scalar_kernels();
}

// A null pointer is allowed with n == 0: an empty shard (world size > parameters) has no buffer.
void check_range(const char* call, const void* p, const char* what, int64_t n) {
  if (n < 0) ZS_THROW(invalid_argument, call << ": negative element count " << n);
  if (n > 0 && p == nullptr) ZS_THROW(invalid_argument, call << ": " << what << " is null");
}

// The kernels link without the library's types.cpp (dtype_name()).
const char* name_of(DType d) {
  return d == DType::f32 ? "f32" : d == DType::bf16 ? "bf16" : d == DType::f16 ? "f16" : "?";
}

void check_dtype(const char* call, DType d) {
  if (!valid_dtype(d)) {
    ZS_THROW(invalid_argument, call << ": invalid dtype " << static_cast<int>(d));
  }
}

}  // namespace

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::scalar:
      return "scalar";
    case Isa::avx2:
      return "avx2";
    case Isa::avx512:
      return "avx512";
  }
  return "?";
}

bool isa_supported(Isa isa) {
  const int i = static_cast<int>(isa);
  return i < kIsaCount && support().supported[i];
}

// A function-local static: detection and the environment are read on first use, thread-safely.
Isa best_isa() {
  static const Isa isa = parse_isa_env();
  return isa;
}

namespace {

void check_kind(const char* call, OptimizerKind kind) {
  if (static_cast<int>(kind) > static_cast<int>(OptimizerKind::muon)) {
    ZS_THROW(invalid_argument, call << ": unknown optimizer kind " << static_cast<int>(kind));
  }
}

// Everything but the hyperparameters; `h` says which moments the rule reads.
void check_update_args(const char* call, const UpdateHyper& h, const UpdateArgs& a) {
  check_range(call, a.master, "master", a.n);
  check_range(call, a.grad, "grad", a.n);
  check_dtype(call, a.grad_dtype);
  if (a.out != nullptr) check_dtype(call, a.out_dtype);
  // A bf16 master belongs to a bf16 model: its gradients are bf16 (or their f32 sum) and its
  // copy-out, if any, is bf16.
  if (a.master_dtype == DType::bf16) {
    if (a.grad_dtype == DType::f16 || (a.out != nullptr && a.out_dtype != DType::bf16)) {
      ZS_THROW(invalid_argument, call << ": a bf16 master takes f32 or bf16 gradients and a bf16 "
                                         "copy-out (got grad "
                                      << name_of(a.grad_dtype) << ", out "
                                      << (a.out ? name_of(a.out_dtype) : "none") << ")");
    }
  } else if (a.master_dtype != DType::f32) {
    ZS_THROW(invalid_argument,
             call << ": master of dtype " << name_of(a.master_dtype) << " (f32 or bf16)");
  }
  const StateFormat f = a.state_format;
  if (f != StateFormat::f32 && f != StateFormat::bf16 && f != StateFormat::q8) {
    ZS_THROW(invalid_argument, call << ": invalid state format " << static_cast<int>(f));
  }
  // The states each rule reads; a null one would only surface as a crash inside the loop.
  const bool adam = h.kind == OptimizerKind::adam || h.kind == OptimizerKind::adamw;
  const bool sgd_momentum = h.kind == OptimizerKind::sgd && h.momentum != 0;
  const bool muon = h.kind == OptimizerKind::muon;
  const bool one = adam || sgd_momentum || h.kind == OptimizerKind::lion || muon;
  if (one) check_range(call, a.state0, "state0", a.n);
  if (muon) check_range(call, a.dir, "dir", a.n);
  if (adam) check_range(call, a.state1, "state1", a.n);
  if (f != StateFormat::q8) return;
  if (a.block < 1 || a.block > kMaxStateBlock) {
    ZS_THROW(invalid_argument,
             call << ": q8 block of " << a.block << " elements (1.." << kMaxStateBlock << ")");
  }
  const int64_t blocks = (a.n + a.block - 1) / a.block;
  if (one) check_range(call, a.absmax0, "absmax0", blocks);
  if (adam) check_range(call, a.absmax1, "absmax1", blocks);
}

}  // namespace

// Two rounds of the update's own hash (scalar_convert.hpp) over the step's two halves and the
// unit: a different key for every (step, unit) pair in practice.
uint32_t rounding_key(int64_t step, int unit) {
  const uint64_t s = uint64_t(step);
  const uint32_t k = cvt::rounding_bits(uint32_t(s >> 32) ^ 0x5A17C0DEu, uint32_t(s));
  return cvt::rounding_bits(k, uint32_t(unit));
}

void optimizer_update(Isa isa, const UpdateHyper& h, const UpdateArgs& a) {
  constexpr const char* call = "optimizer_update";
  check_kind(call, h.kind);
  check_update_args(call, h, a);
  if (a.n == 0) return;  // after the checks, so a bad call fails even on an empty shard
  table(isa).optimizer_update(h, a);
}

void optimizer_update_segments(Isa isa, const UpdateSegment* segments, int count,
                               const UpdateArgs& a) {
  constexpr const char* call = "optimizer_update_segments";
  if (a.state_format != StateFormat::q8) {
    ZS_THROW(invalid_argument, call << ": only q8 states are updated by segments");
  }
  if (count < 0 || (count > 0 && segments == nullptr)) {
    ZS_THROW(invalid_argument, call << ": " << count << " segments at " << segments);
  }
  int64_t at = 0;
  for (int s = 0; s < count; ++s) {
    const UpdateSegment& g = segments[s];
    if (g.h == nullptr) ZS_THROW(invalid_argument, call << ": segment " << s << " has no hyper");
    if (g.begin < at || g.end < g.begin || g.end > a.n) {
      ZS_THROW(invalid_argument, call << ": segment " << s << " [" << g.begin << ", " << g.end
                                      << ") is not ascending inside [0, " << a.n << ")");
    }
    check_kind(call, g.h->kind);
    // One optimizer, or Muon beside Adam/AdamW (a Muon engine's groups): the blocks' moments
    // then mean the same to each (state0 the signed first moment, state1 Adam's second).
    auto family = [](OptimizerKind k) {
      return k == OptimizerKind::adam || k == OptimizerKind::adamw || k == OptimizerKind::muon
                 ? OptimizerKind::muon
                 : k;
    };
    if (family(g.h->kind) != family(segments[0].h->kind)) {
      ZS_THROW(invalid_argument, call << ": segments of different optimizers");
    }
    at = g.end;
  }
  if (count == 0) return;
  // Every segment's arrays: an SGD segment with momentum reads more states than one without,
  // Adam reads state1, Muon its direction.
  for (int s = 0; s < count; ++s) check_update_args(call, *segments[s].h, a);
  if (a.n == 0) return;
  table(isa).optimizer_update_segments(segments, count, a);
}

namespace {

void check_blocks(const char* call, int64_t n, int64_t block, const void* q, const void* absmax,
                  const void* x) {
  if (block < 1) ZS_THROW(invalid_argument, call << ": block of " << block << " elements");
  check_range(call, x, "x", n);
  check_range(call, q, "q", n);
  check_range(call, absmax, "absmax", (n + block - 1) / block);
}

}  // namespace

void quantize_blocks(Isa isa, const float* x, int64_t n, int64_t block, bool is_signed, uint8_t* q,
                     float* absmax) {
  check_blocks("quantize_blocks", n, block, q, absmax, x);
  table(isa).quantize_blocks(x, n, block, is_signed, q, absmax);
}

void dequantize_blocks(Isa isa, const uint8_t* q, const float* absmax, int64_t n, int64_t block,
                       bool is_signed, float* x) {
  check_blocks("dequantize_blocks", n, block, q, absmax, x);
  table(isa).dequantize_blocks(q, absmax, n, block, is_signed, x);
}

void widen_moment(Isa isa, StateFormat f, const void* data, const float* absmax, int64_t n,
                  int64_t block, bool is_signed, float* out) {
  if (f == StateFormat::q8)
    return dequantize_blocks(isa, static_cast<const uint8_t*>(data), absmax, n, block, is_signed,
                             out);
  convert(isa, data, f == StateFormat::bf16 ? DType::bf16 : DType::f32, out, DType::f32, n);
}

void narrow_moment(Isa isa, StateFormat f, const float* in, int64_t n, int64_t block,
                   bool is_signed, void* data, float* absmax) {
  if (f == StateFormat::q8)
    return quantize_blocks(isa, in, n, block, is_signed, static_cast<uint8_t*>(data), absmax);
  convert(isa, in, DType::f32, data, f == StateFormat::bf16 ? DType::bf16 : DType::f32, n);
}

double sum_squares(Isa isa, const void* x, DType dtype, int64_t n) {
  check_range("sum_squares", x, "x", n);
  check_dtype("sum_squares", dtype);
  return table(isa).sum_squares(x, dtype, n);
}

void convert(Isa isa, const void* src, DType src_dtype, void* dst, DType dst_dtype, int64_t n) {
  check_range("convert", src, "src", n);
  check_range("convert", dst, "dst", n);
  check_dtype("convert", src_dtype);
  check_dtype("convert", dst_dtype);
  table(isa).convert(src, src_dtype, dst, dst_dtype, n);
}

void accumulate(Isa isa, float* acc, const void* g, DType g_dtype, int64_t n) {
  check_range("accumulate", acc, "acc", n);
  check_range("accumulate", g, "g", n);
  check_dtype("accumulate", g_dtype);
  table(isa).accumulate(acc, g, g_dtype, n);
}

void add_into(Isa isa, void* inout, const void* in, DType dtype, int64_t n) {
  check_range("add_into", inout, "inout", n);
  check_range("add_into", in, "in", n);
  check_dtype("add_into", dtype);
  table(isa).add_into(inout, in, dtype, n);
}

// The stream counts index a table of fixed-count instantiations, hence the hard limit.
void same_bytes(Isa isa, const float* const* reads, int read_streams, float* const* writes,
                int write_streams, int64_t n) {
  constexpr const char* call = "same_bytes";
  for (int streams : {read_streams, write_streams}) {
    if (streams < 0 || streams > kMaxSameBytesStreams) {
      ZS_THROW(invalid_argument,
               call << ": " << streams << " streams (0.." << kMaxSameBytesStreams << " allowed)");
    }
  }
  if (n < 0) ZS_THROW(invalid_argument, call << ": negative element count " << n);
  if ((read_streams > 0 && reads == nullptr) || (write_streams > 0 && writes == nullptr)) {
    ZS_THROW(invalid_argument, call << ": stream pointer array is null");
  }
  for (int r = 0; r < read_streams; ++r) check_range(call, reads[r], "a read stream", n);
  for (int w = 0; w < write_streams; ++w) check_range(call, writes[w], "a write stream", n);
  table(isa).same_bytes(reads, read_streams, writes, write_streams, n);
}

// Out-of-line copies of the inline reference conversions, for code outside the kernels.
float bf16_to_float(uint16_t h) {
  return cvt::bf16_to_float(h);
}
uint16_t float_to_bf16(float f) {
  return cvt::float_to_bf16(f);
}
float f16_to_float(uint16_t h) {
  return cvt::f16_to_float(h);
}
uint16_t float_to_f16(float f) {
  return cvt::float_to_f16(f);
}

}  // namespace zeroshard::cpu
