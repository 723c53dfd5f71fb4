// AVX2 + F16C variant (this file is compiled with -mavx2 -mf16c). Eight f32 lanes per vector;
// arithmetic uses GCC's vector operators on __m256, which map to the IEEE vaddps/vmulps/vdivps.

#include <immintrin.h>

#include "kernels/cpu/isa_table.hpp"

namespace zeroshard::cpu {
namespace {

struct Avx2Vec {
  using T = __m256;
  struct Acc {
    __m256d lo, hi;
  };
  static constexpr int64_t kWidth = 8;

  static T set1(float x) { return _mm256_set1_ps(x); }
  static T load_f32(const float* p) { return _mm256_loadu_ps(p); }
  static void store_f32(float* p, T x) { _mm256_storeu_ps(p, x); }

  // bf16 is the top half of an f32: zero-extend and shift, exact.
  static T load_bf16(const uint16_t* p) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
  // Same integer rounding as cvt::float_to_bf16, eight lanes at a time.
  static void store_bf16(uint16_t* p, T x) {
    const __m256i u = _mm256_castps_si256(x);
    const __m256i hi = _mm256_srli_epi32(u, 16);
    const __m256i lsb = _mm256_and_si256(hi, _mm256_set1_epi32(1));
    const __m256i bias = _mm256_add_epi32(_mm256_set1_epi32(0x7FFF), lsb);
    const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(u, bias), 16);
    const __m256i quiet = _mm256_or_si256(hi, _mm256_set1_epi32(0x40));
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    const __m256i r = _mm256_blendv_epi8(rounded, quiet, nan);
    // Every lane is < 2^16, so the saturating pack is exact; it packs within 128-bit halves,
    // and the permute gathers the two useful quarters into the low half.
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0xD8);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
  }
  // F16C converts exactly when widening and rounds to nearest even (immediate, not MXCSR) when
  // narrowing; scalar_convert.hpp reproduces its NaN and subnormal results bit for bit.
  static T load_f16(const uint16_t* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static void store_f16(uint16_t* p, T x) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT));
  }

  // cvt::rounding_bits and cvt::round_bf16_stochastic, eight lanes (indices index..index+7).
  static T round_bf16_sr(T x, uint32_t key, uint32_t index) {
    const __m256i i =
        _mm256_add_epi32(_mm256_set1_epi32(int(index)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    __m256i h = _mm256_xor_si256(_mm256_mullo_epi32(i, _mm256_set1_epi32(int(0x9E3779B1u))),
                                 _mm256_set1_epi32(int(key)));
    h = _mm256_xor_si256(h, _mm256_srli_epi32(h, 16));
    h = _mm256_mullo_epi32(h, _mm256_set1_epi32(0x7FEB352D));
    h = _mm256_xor_si256(h, _mm256_srli_epi32(h, 15));
    h = _mm256_mullo_epi32(h, _mm256_set1_epi32(int(0x846CA68Bu)));
    h = _mm256_xor_si256(h, _mm256_srli_epi32(h, 16));
    const __m256i u = _mm256_castps_si256(x);
    const __m256i r =
        _mm256_and_si256(_mm256_add_epi32(u, _mm256_and_si256(h, _mm256_set1_epi32(0xFFFF))),
                         _mm256_set1_epi32(int(0xFFFF0000u)));
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    return _mm256_castsi256_ps(_mm256_blendv_epi8(r, u, nan));
  }

  static T sqrt(T x) { return _mm256_sqrt_ps(x); }
  // Blend order mirrors ScalarVec::sign: start from c - c (+0 or NaN), then -1, then +1.
  static T sign(T c) {
    const T zero = _mm256_setzero_ps();
    T r = _mm256_sub_ps(c, c);
    r = _mm256_blendv_ps(r, _mm256_set1_ps(-1.0f), _mm256_cmp_ps(c, zero, _CMP_LT_OQ));
    return _mm256_blendv_ps(r, _mm256_set1_ps(1.0f), _mm256_cmp_ps(c, zero, _CMP_GT_OQ));
  }

  static T zero() { return _mm256_setzero_ps(); }
  static T bit_xor(T a, T b) { return _mm256_xor_ps(a, b); }

  // Squares are taken in double (exact), eight lanes as two halves of four.
  static Acc acc_zero() { return {_mm256_setzero_pd(), _mm256_setzero_pd()}; }
  static Acc acc_add_square(Acc acc, T x) {
    const __m256d lo = _mm256_cvtps_pd(_mm256_castps256_ps128(x));
    const __m256d hi = _mm256_cvtps_pd(_mm256_extractf128_ps(x, 1));
    return {_mm256_add_pd(acc.lo, _mm256_mul_pd(lo, lo)),
            _mm256_add_pd(acc.hi, _mm256_mul_pd(hi, hi))};
  }
  // A fixed combination order, so a given input always gives the same sum.
  static double acc_total(Acc acc) {
    alignas(32) double lanes[4];
    _mm256_store_pd(lanes, _mm256_add_pd(acc.lo, acc.hi));
    return (lanes[0] + lanes[1]) + (lanes[2] + lanes[3]);
  }

  // Q8Code::point_bits() lane-wise, times absmax (a code of 0 gives 0 × absmax, as there).
  template <bool S>
  static T decode8(const uint8_t* q, T absmax) {
    const __m256i q32 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q)));
    const __m256i c = S ? _mm256_and_si256(q32, _mm256_set1_epi32(0x7F)) : q32;
    __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(c, _mm256_set1_epi32(Q8Code<S>::kOff)), 20);
    if constexpr (S) bits = _mm256_or_si256(bits, _mm256_slli_epi32(_mm256_srli_epi32(q32, 7), 31));
    bits = _mm256_andnot_si256(_mm256_cmpeq_epi32(c, _mm256_setzero_si256()), bits);
    return _mm256_mul_ps(_mm256_castsi256_ps(bits), absmax);
  }
  static T abs(T x) { return _mm256_and_ps(x, _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF))); }
  // vmaxps returns its second operand when either is NaN or both are zero: a > b ? a : b.
  static T max(T a, T b) { return _mm256_max_ps(a, b); }
  static float reduce_max(T x) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
    return _mm_cvtss_f32(m);
  }
  // Q8Code::encode() lane-wise.
  template <bool S>
  static void encode8(T x, uint8_t* q) {
    const __m256i b = _mm256_castps_si256(x);
    const __m256i mag = _mm256_and_si256(b, _mm256_set1_epi32(0x7FFFFFFF));
    __m256i c =
        _mm256_sub_epi32(_mm256_srli_epi32(_mm256_add_epi32(mag, _mm256_set1_epi32(1 << 19)), 20),
                         _mm256_set1_epi32(Q8Code<S>::kOff));
    c = _mm256_min_epi32(_mm256_max_epi32(c, _mm256_setzero_si256()),
                         _mm256_set1_epi32(Q8Code<S>::kMax));
    // Both sides below 2^31: the signed compare is the unsigned one.
    const __m256i low = _mm256_cmpgt_epi32(mag, _mm256_set1_epi32(Q8Code<S>::kHalfMin - 1));
    c = _mm256_max_epi32(c, _mm256_and_si256(low, _mm256_set1_epi32(1)));
    if constexpr (S) {
      // The sign where the code is not 0 and the value not NaN.
      const __m256i nz = _mm256_andnot_si256(_mm256_cmpgt_epi32(mag, _mm256_set1_epi32(0x7F800000)),
                                             _mm256_cmpgt_epi32(c, _mm256_setzero_si256()));
      c = _mm256_or_si256(c, _mm256_and_si256(nz, _mm256_slli_epi32(_mm256_srli_epi32(b, 31), 7)));
    }
    // The low byte of each lane, gathered into the low 4 bytes of each 128-bit half.
    const __m256i bytes = _mm256_shuffle_epi8(
        c, _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, 0, 4, 8,
                            12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1));
    const __m128i packed =
        _mm_unpacklo_epi32(_mm256_castsi256_si128(bytes), _mm256_extracti128_si256(bytes, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(q), packed);
  }
};

}  // namespace

const KernelTable& avx2_kernels() {
  static constexpr KernelTable table = make_kernel_table<Avx2Vec>();
  return table;
}

}  // namespace zeroshard::cpu
