// AVX-512 variant (compiled with -mavx512f -mavx512bw -mavx512vl -mavx2 -mf16c). Sixteen f32
// lanes per vector; only AVX512F/BW/VL instructions, no DQ, FP16 or BF16 extensions, so it runs
// on every AVX-512 server since Skylake-SP. One exception, taken only where the CPU has it: the
// q8 dequantizer's VBMI byte lookup (dequantize_wide()).

// GCC 12's AVX-512 headers self-initialise their "undefined" vectors (`__m512 __Y = __Y;`),
// which trips -Wmaybe-uninitialized and -Wuninitialized once inlined (GCC bug 105593); the warning
// is about the header's idiom, not this code.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif
#include <immintrin.h>
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif

#include <array>

#include "kernels/cpu/isa_table.hpp"

namespace zeroshard::cpu {
namespace {

struct Avx512Vec {
  using T = __m512;
  struct Acc {
    __m512d lo, hi;
  };
  static constexpr int64_t kWidth = 16;

  static T set1(float x) { return _mm512_set1_ps(x); }
  static T load_f32(const float* p) { return _mm512_loadu_ps(p); }
  static void store_f32(float* p, T x) { _mm512_storeu_ps(p, x); }

  // bf16 is the top half of an f32: zero-extend and shift, exact.
  static T load_bf16(const uint16_t* p) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
  // Same integer rounding as cvt::float_to_bf16, sixteen lanes at a time.
  static void store_bf16(uint16_t* p, T x) {
    const __m512i u = _mm512_castps_si512(x);
    const __m512i hi = _mm512_srli_epi32(u, 16);
    const __m512i lsb = _mm512_and_si512(hi, _mm512_set1_epi32(1));
    const __m512i bias = _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), lsb);
    const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(u, bias), 16);
    const __m512i quiet = _mm512_or_si512(hi, _mm512_set1_epi32(0x40));
    const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    const __m512i r = _mm512_mask_blend_epi32(nan, rounded, quiet);
    // vpmovdw truncates each lane to 16 bits; every lane already fits.
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(r));
  }
  // Same F16C semantics as the AVX2 file, sixteen lanes (EVEX forms of vcvtph2ps/vcvtps2ph).
  static T load_f16(const uint16_t* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static void store_f16(uint16_t* p, T x) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                        _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT));
  }

  // cvt::rounding_bits and cvt::round_bf16_stochastic, sixteen lanes (index..index+15).
  static T round_bf16_sr(T x, uint32_t key, uint32_t index) {
    const __m512i i =
        _mm512_add_epi32(_mm512_set1_epi32(int(index)),
                         _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
    __m512i h = _mm512_xor_si512(_mm512_mullo_epi32(i, _mm512_set1_epi32(int(0x9E3779B1u))),
                                 _mm512_set1_epi32(int(key)));
    h = _mm512_xor_si512(h, _mm512_srli_epi32(h, 16));
    h = _mm512_mullo_epi32(h, _mm512_set1_epi32(0x7FEB352D));
    h = _mm512_xor_si512(h, _mm512_srli_epi32(h, 15));
    h = _mm512_mullo_epi32(h, _mm512_set1_epi32(int(0x846CA68Bu)));
    h = _mm512_xor_si512(h, _mm512_srli_epi32(h, 16));
    const __m512i u = _mm512_castps_si512(x);
    const __m512i r =
        _mm512_and_si512(_mm512_add_epi32(u, _mm512_and_si512(h, _mm512_set1_epi32(0xFFFF))),
                         _mm512_set1_epi32(int(0xFFFF0000u)));
    const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    return _mm512_castsi512_ps(_mm512_mask_blend_epi32(nan, r, u));
  }

  static T sqrt(T x) { return _mm512_sqrt_ps(x); }
  // Blend order mirrors ScalarVec::sign: start from c - c (+0 or NaN), then -1, then +1.
  static T sign(T c) {
    const T zero = _mm512_setzero_ps();
    T r = _mm512_sub_ps(c, c);
    r = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(c, zero, _CMP_LT_OQ), r, _mm512_set1_ps(-1.0f));
    return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(c, zero, _CMP_GT_OQ), r, _mm512_set1_ps(1.0f));
  }

  static T zero() { return _mm512_setzero_ps(); }
  // _mm512_xor_ps needs AVX512DQ; the integer xor is the same bits.
  static T bit_xor(T a, T b) {
    return _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(a), _mm512_castps_si512(b)));
  }

  // Squares in double (exact), sixteen lanes as two halves of eight.
  static Acc acc_zero() { return {_mm512_setzero_pd(), _mm512_setzero_pd()}; }
  static Acc acc_add_square(Acc acc, T x) {
    const __m512d lo = _mm512_cvtps_pd(_mm512_castps512_ps256(x));
    const __m512d hi =
        _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1)));
    return {_mm512_add_pd(acc.lo, _mm512_mul_pd(lo, lo)),
            _mm512_add_pd(acc.hi, _mm512_mul_pd(hi, hi))};
  }
  static double acc_total(Acc acc) { return _mm512_reduce_add_pd(_mm512_add_pd(acc.lo, acc.hi)); }

  // q8: the 256 code points in sixteen registers, and no gather (slow on some cores): each
  // pair of registers is a 32-entry table for vpermt2ps (index bits 0–4), and bits 5, 6 and 7
  // pick among the eight results.
  struct CodeTable {
    __m512 r[16];
  };
  static CodeTable code_table(const float* code) {
    CodeTable t;
    for (int i = 0; i < 16; ++i) t.r[i] = _mm512_loadu_ps(code + 16 * i);
    return t;
  }
  static T gather(const CodeTable& t, const uint8_t* q) {
    const __m512i idx = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)));
    __m512 v[8];
    for (int i = 0; i < 8; ++i) v[i] = _mm512_permutex2var_ps(t.r[2 * i], idx, t.r[2 * i + 1]);
    for (int bit = 5, n = 8; bit < 8; ++bit, n /= 2) {
      const __mmask16 hi = _mm512_test_epi32_mask(idx, _mm512_set1_epi32(1 << bit));
      for (int i = 0; i < n / 2; ++i) v[i] = _mm512_mask_blend_ps(hi, v[2 * i], v[2 * i + 1]);
    }
    return v[0];
  }
  // With AVX512-VBMI (Ice Lake and later, Zen 4), 64 indices at a time and no float lookup:
  // each byte of the 64 code points comes from its byte plane (QuantCode::plane) by two
  // vpermi2b over 128 entries, blended on index bit 7, and the four bytes are interleaved into
  // floats. The unpacks interleave within 128-bit lanes, so the indices are first permuted
  // (kVbmiOrder) to come out in order. Bitwise code[q] × absmax, as gather().
  static int64_t dequantize_wide(const QuantCode& c, const uint8_t* q, float absmax, float* out,
                                 int64_t n) {
    static const bool vbmi = __builtin_cpu_supports("avx512vbmi");
    return vbmi ? dequantize_vbmi(c, q, absmax, out, n / 64 * 64) : 0;
  }
  __attribute__((target("avx512vbmi"))) static int64_t dequantize_vbmi(const QuantCode& c,
                                                                       const uint8_t* q,
                                                                       float absmax, float* out,
                                                                       int64_t n) {
    // Position 16 L + 4 k + j (lane L of the four unpacked outputs k) takes index 16 k + 4 L + j.
    alignas(64) static constexpr auto kVbmiOrder = [] {
      std::array<uint8_t, 64> o{};
      for (int L = 0; L < 4; ++L)
        for (int k = 0; k < 4; ++k)
          for (int j = 0; j < 4; ++j) o[size_t(16 * L + 4 * k + j)] = uint8_t(16 * k + 4 * L + j);
      return o;
    }();
    __m512i plane[4][4];
    for (int b = 0; b < 4; ++b)
      for (int k = 0; k < 4; ++k) plane[b][k] = _mm512_loadu_si512(c.plane[b] + 64 * k);
    const __m512i order = _mm512_load_si512(kVbmiOrder.data());
    const __m512 scale = _mm512_set1_ps(absmax);
    for (int64_t i = 0; i < n; i += 64) {
      const __m512i idx = _mm512_permutexvar_epi8(order, _mm512_loadu_si512(q + i));
      const __mmask64 top = _mm512_movepi8_mask(idx);
      __m512i byte[4];
      for (int b = 0; b < 4; ++b)
        byte[b] =
            _mm512_mask_blend_epi8(top, _mm512_permutex2var_epi8(plane[b][0], idx, plane[b][1]),
                                   _mm512_permutex2var_epi8(plane[b][2], idx, plane[b][3]));
      const __m512i lo01 = _mm512_unpacklo_epi8(byte[0], byte[1]);
      const __m512i hi01 = _mm512_unpackhi_epi8(byte[0], byte[1]);
      const __m512i lo23 = _mm512_unpacklo_epi8(byte[2], byte[3]);
      const __m512i hi23 = _mm512_unpackhi_epi8(byte[2], byte[3]);
      const __m512i f[4] = {_mm512_unpacklo_epi16(lo01, lo23), _mm512_unpackhi_epi16(lo01, lo23),
                            _mm512_unpacklo_epi16(hi01, hi23), _mm512_unpackhi_epi16(hi01, hi23)};
      for (int k = 0; k < 4; ++k)
        _mm512_storeu_ps(out + i + 16 * k, _mm512_mul_ps(_mm512_castsi512_ps(f[k]), scale));
    }
    return n;
  }
  static T abs(T x) {
    return _mm512_castsi512_ps(
        _mm512_and_si512(_mm512_castps_si512(x), _mm512_set1_epi32(0x7FFFFFFF)));
  }
  // vmaxps returns its second operand when either is NaN or both are zero: a > b ? a : b.
  static T max(T a, T b) { return _mm512_max_ps(a, b); }
  static float reduce_max(T x) { return _mm512_reduce_max_ps(x); }
  // QuantCode::lookup() lane-wise: the bucket, its entry, the compare of the low bits.
  static void quantize(const QuantCode& c, T x, uint8_t* q) {
    const __m512i u = _mm512_castps_si512(x);
    __m512i mag =
        _mm512_srli_epi32(_mm512_and_si512(u, _mm512_set1_epi32(0x7FFFFFFF)), QuantCode::kKeyShift);
    mag = _mm512_sub_epi32(mag, _mm512_set1_epi32(QuantCode::kMinKey));
    mag = _mm512_min_epi32(_mm512_max_epi32(mag, _mm512_setzero_si512()),
                           _mm512_set1_epi32(QuantCode::kBuckets - 1));
    const __m512i neg = _mm512_srai_epi32(u, 31);
    const __m512i key =
        _mm512_add_epi32(mag, _mm512_and_si512(neg, _mm512_set1_epi32(QuantCode::kBuckets)));
    const __m512i e = _mm512_i32gather_epi32(key, c.entry, 4);
    const __m512i low = _mm512_and_si512(_mm512_xor_si512(u, neg), _mm512_set1_epi32(0xFFFF));
    const __mmask16 up = _mm512_cmpgt_epi32_mask(low, _mm512_srli_epi32(e, 8));
    // q ≤ 254 where the compare can hold: adding 1 stays in the low byte, which vpmovdb keeps.
    const __m512i idx = _mm512_mask_add_epi32(e, up, e, _mm512_set1_epi32(1));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtepi32_epi8(idx));
  }
};

}  // namespace

const KernelTable& avx512_kernels() {
  static constexpr KernelTable table = make_kernel_table<Avx512Vec>();
  return table;
}

}  // namespace zeroshard::cpu
