// AVX-512 variant (compiled with -mavx512f -mavx512bw -mavx512vl -mavx2 -mf16c). Sixteen f32
// lanes per vector; only AVX512F/BW/VL instructions, no DQ, FP16 or BF16 extensions, so it runs
// on every AVX-512 server since Skylake-SP.

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

  // Q8Code::point_bits() lane-wise, times absmax (a code of 0 gives 0 × absmax, as there).
  template <bool S>
  static T decode8(const uint8_t* q, T absmax) {
    const __m512i q32 = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)));
    const __m512i c = S ? _mm512_and_si512(q32, _mm512_set1_epi32(0x7F)) : q32;
    const __mmask16 nz = _mm512_test_epi32_mask(c, c);
    const __m512i bits =
        _mm512_slli_epi32(_mm512_add_epi32(c, _mm512_set1_epi32(Q8Code<S>::kOff)), 20);
    const __m512i sign =
        S ? _mm512_slli_epi32(_mm512_srli_epi32(q32, 7), 31) : _mm512_setzero_si512();
    return _mm512_mul_ps(_mm512_castsi512_ps(_mm512_maskz_or_epi32(nz, bits, sign)), absmax);
  }
  static T abs(T x) {
    return _mm512_castsi512_ps(
        _mm512_and_si512(_mm512_castps_si512(x), _mm512_set1_epi32(0x7FFFFFFF)));
  }
  // vmaxps returns its second operand when either is NaN or both are zero: a > b ? a : b.
  static T max(T a, T b) { return _mm512_max_ps(a, b); }
  static float reduce_max(T x) { return _mm512_reduce_max_ps(x); }
  // Q8Code::encode() lane-wise. The pattern's code before the offset is below 2^12, so the
  // offset's subtraction saturating at 0 (vpsubusw on the lane's low half; the high half is 0)
  // and the narrowing saturating at 255 (vpmovusdb) are the clamps.
  template <bool S>
  static void encode8(T x, uint8_t* q) {
    const __m512i b = _mm512_castps_si512(x);
    const __m512i mag = _mm512_and_si512(b, _mm512_set1_epi32(0x7FFFFFFF));
    __m512i c =
        _mm512_subs_epu16(_mm512_srli_epi32(_mm512_add_epi32(mag, _mm512_set1_epi32(1 << 19)), 20),
                          _mm512_set1_epi32(Q8Code<S>::kOff));
    if constexpr (S) c = _mm512_min_epu32(c, _mm512_set1_epi32(Q8Code<S>::kMax));
    const __mmask16 low = _mm512_cmpge_epi32_mask(mag, _mm512_set1_epi32(Q8Code<S>::kHalfMin));
    c = _mm512_mask_max_epi32(c, low, c, _mm512_set1_epi32(1));
    if constexpr (S) {
      // Where c > 0 and x is not NaN, c | ((b >> 24) & 0x80): bit 7 of b >> 24 is the sign.
      const __mmask16 nz = _mm512_mask_cmple_epi32_mask(_mm512_test_epi32_mask(c, c), mag,
                                                        _mm512_set1_epi32(0x7F800000));
      c = _mm512_mask_ternarylogic_epi32(c, nz, _mm512_srli_epi32(b, 24), _mm512_set1_epi32(0x80),
                                         0xF8);
    }
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtusepi32_epi8(c));
  }
};

}  // namespace

const KernelTable& avx512_kernels() {
  static constexpr KernelTable table = make_kernel_table<Avx512Vec>();
  return table;
}

}  // namespace zeroshard::cpu
