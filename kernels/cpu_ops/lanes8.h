// 8 float32 lanes of a float32 or bfloat16 tensor's elements (the AVX2 paths of ops.cpp
// and fused.cpp): ld8 loads them as float32 (bfloat16 exactly, by its bits), rnd8 rounds
// to T's precision (bf16_bits' arithmetic: half to even, NaN -> the quiet NaN), st8
// stores values already in T's precision.
#pragma once
#include <c10/util/BFloat16.h>
#include <immintrin.h>
#include <cstdint>
#include <type_traits>

#include "simd.h"

#if defined(__AVX2__) && defined(__FMA__)
inline __m256 ld8(const float* p) { return load8(p); }
inline __m256 ld8(const c10::BFloat16* p) { return load8(reinterpret_cast<const uint16_t*>(p)); }
template <typename T> inline __m256 rnd8(__m256 x) {
  if constexpr (std::is_same_v<T, float>) {
    return x;
  } else {
    const __m256i b = _mm256_castps_si256(x);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
    const __m256i r = _mm256_and_si256(_mm256_add_epi32(_mm256_add_epi32(b, _mm256_set1_epi32(0x7FFF)), odd),
                                       _mm256_set1_epi32(static_cast<int>(0xFFFF0000u)));
    return _mm256_blendv_ps(_mm256_castsi256_ps(r), _mm256_castsi256_ps(_mm256_set1_epi32(0x7FC00000)),
                            _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
  }
}
inline void st8(float* p, __m256 x) { _mm256_storeu_ps(p, x); }
inline void st8(c10::BFloat16* p, __m256 x) {
  const __m256i h = _mm256_srli_epi32(_mm256_castps_si256(x), 16);
  const __m256i w = _mm256_permute4x64_epi64(_mm256_packus_epi32(h, h), 0x08);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(w));
}
#endif
