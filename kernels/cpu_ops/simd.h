// float32 helpers the C++ ops share: 16 lanes (ops.cpp, fused.cpp, batch_gemm.cpp) and
// 8 (the AVX2 paths of ops.cpp, fused.cpp, int4_gemv.cpp and int8_gemv.cpp).
//
// exp16: exp(x) in 16 float32 lanes (Cephes' expf: x = n ln2 + r, a degree-7 polynomial in r,
// times 2^n by vscalefps; within 2 ulp of std::exp; below -104 it is 0, above 88.7 inf).
// std::exp one element at a time was most of a decode row's attention (9 heads x the
// context's exps, ~20 ns each) and of silu_mul.
//
// reduce16: 16 vectors -> one, lane j the sum of vector j's lanes, by one fixed tree (the
// same bits for a vector wherever it sits among the 16): 45 instructions where 16
// horizontal sums take ~130.
#pragma once
#include <immintrin.h>
#include <cstdint>

#if defined(__AVX512F__)
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-104.f));           // below: 0 after scaling anyway
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_add_ps(_mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r), _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

inline __m512 reduce16(const __m512* a) {
  __m512 u[8], w[4];
  for (int i = 0; i < 8; ++i)
    u[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]),
                         _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {
    const __m512d p = _mm512_castps_pd(u[2 * i]), q = _mm512_castps_pd(u[2 * i + 1]);
    w[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(p, q)),
                         _mm512_castpd_ps(_mm512_unpackhi_pd(p, q)));
  }
  // w[i]'s 128-bit block L: partial sums of acc 4i..4i+3 over that block's lanes
  const __m512 s01 = _mm512_add_ps(_mm512_shuffle_f32x4(w[0], w[1], 0x88), _mm512_shuffle_f32x4(w[0], w[1], 0xDD));
  const __m512 s23 = _mm512_add_ps(_mm512_shuffle_f32x4(w[2], w[3], 0x88), _mm512_shuffle_f32x4(w[2], w[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(s01, s23, 0x88), _mm512_shuffle_f32x4(s01, s23, 0xDD));
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
// hsum8: the 8 lanes' sum by one fixed tree (the AVX2 kernels' reduce; the same bits for a
// vector wherever it sits)
inline float hsum8(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}

// exp8: exp16's polynomial in 8 lanes; 2^n by the exponent's bits (no vscalefps), so below
// ln(FLT_MIN) = -87.34 it is 0 (std::exp: a subnormal there), above ln(FLT_MAX) inf
inline __m256 exp8(__m256 x) {
  const __m256 live = _mm256_cmp_ps(x, _mm256_set1_ps(-87.33654f), _CMP_GE_OQ);
  const __m256 inf = _mm256_cmp_ps(x, _mm256_set1_ps(88.72283f), _CMP_GT_OQ);
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.33654f)), _mm256_set1_ps(88.37626f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_add_ps(_mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r), _mm256_set1_ps(1.f));
  // n in [-126, 127]: 2^n is the float with exponent field n + 127
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  const __m256 y = _mm256_and_ps(_mm256_mul_ps(p, _mm256_castsi256_ps(e)), live);
  return _mm256_blendv_ps(y, _mm256_set1_ps(__builtin_inff()), inf);
}

// reduce8: 8 vectors -> one, lane j the sum of vector j's lanes, by one fixed tree (as
// reduce16: the same bits for a vector wherever it sits among the 8)
inline __m256 reduce8(const __m256* a) {
  const __m256 h01 = _mm256_hadd_ps(a[0], a[1]), h23 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 h45 = _mm256_hadd_ps(a[4], a[5]), h67 = _mm256_hadd_ps(a[6], a[7]);
  const __m256 lo = _mm256_hadd_ps(h01, h23), hi = _mm256_hadd_ps(h45, h67);
  // lo's 128-bit halves: vectors 0..3's sums over lanes 0..3 and over 4..7 (hi: 4..7)
  return _mm256_add_ps(_mm256_permute2f128_ps(lo, hi, 0x20), _mm256_permute2f128_ps(lo, hi, 0x31));
}

// load8: 8 values as float32 (bfloat16 by its bits: exact)
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(
      _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}
#endif
