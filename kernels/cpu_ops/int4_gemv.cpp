// x @ w.T for int4 weights at a few rows (a decode step, a speculative verify), read once
// from memory: the batch-1 matmul is bandwidth-bound, and torch's int4 kernel reaches
// ~9 GB/s of the ~19 a core streams here (30 SmolLM2 layers, one core: 7.0 ms a token on
// torch's kernel, 4.5-5.1 on this one).
//
// The weight (shared/engine/quant.py: Int4Weight, packed by gemv_pack in
// kernels/cpu_ops/gemv.py): codes q in 0..15, w = (q - 8) * scale + zero per group of 32
// input channels, scale and zero bfloat16 [N, K/32]. codes [N, K/2] uint8: each 64 inputs
// (groups 2b and 2b + 1) are 32 bytes, byte i holding input i of the first group in its
// low nibble and input i of the second in its high nibble.
//
// Per output row n: y = sum_g scale_g * dot(q_g - 8, x_g) + zero_g * sum(x_g), each dot on
// bfloat16 pairs with float32 sums (AVX512-BF16 vdpbf16ps), x rounded to bfloat16 first as
// torch's int4 kernel rounds it. A row's result is the same bits whatever the other rows
// of x (each row is summed alone, in one order): a speculative verify sees what a decode
// step would. On a CPU with AVX2 alone (AMD Zen 2/3: this project's CI machines) the same
// walk on 8 float32 lanes (below), and int4_dequant writes float32 too (torch's bfloat16
// GEMM is slow there). Built with neither, int4_simd() is false and the Python side keeps
// torch's int4 kernel.
#include "aten.h"
#include <immintrin.h>
#include <cstdint>
#include <cstring>
#include <vector>

#include "bf16.h"
#include "helper.h"
#include "simd.h"
#include "tiles.h"

namespace {

constexpr int64_t kGroup = 32;
// software prefetch distance in the codes (bytes; the scales and zeros, 1/8 of their size,
// a proportional distance): a tile reads 4 rows at once, a pattern the hardware prefetcher
// follows badly. Measured (30 SmolLM2 layers, M = 1, one core): no prefetch 6.4 ms a token,
// 2 KiB ahead 5.2, 4 KiB 4.7, 6 KiB 4.7, torch's kernel 7.0
#ifndef PF_BYTES
#define PF_BYTES 4096
#endif

// one row of x as bfloat16 bits, and its per-group sums (float32, in input order)
template <typename T>
void prep_row(const T* x, int64_t K, uint16_t* xb, float* xs) {
  for (int64_t k = 0; k < K; ++k) {
    if constexpr (std::is_same_v<T, c10::BFloat16>) xb[k] = x[k].x;
    else xb[k] = bf16_bits(static_cast<float>(x[k]));
  }
  for (int64_t g = 0; g < K / kGroup; ++g) {
    float s = 0.f;
    for (int64_t k = 0; k < kGroup; ++k) s += bf16_float(xb[g * kGroup + k]);
    xs[g] = s;
  }
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
constexpr bool kSimd = true;

inline __m512 bf16x16(__mmask16 m, const uint16_t* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}

// NR weight rows (from wq, sc, ze, each row `ng` groups on) against MR rows of x:
// out[r * MR + m]. A block's 32 bytes become 64 16-bit words 0x4300 | q: bfloat16(128 + q),
// exact; dot(128 + q, x) - 136 sum(x) = dot(q - 8, x), so the 136 goes into the zero term,
// zero - 136 scale (exact in float32). Each (r, m) pair runs the same instructions in the
// same order whatever NR and MR are, so tiles of any shape give the same bits.
template <int NR, int MR>
void tile(const uint8_t* wq, const uint16_t* sc, const uint16_t* ze, int64_t ng,
          const uint16_t* const* xb, const float* const* xs, float* out) {
  const __m512i lo4 = _mm512_set1_epi16(0x000F), bias = _mm512_set1_epi16(0x4300);
  const int64_t rb = ng * 16;   // bytes of codes per weight row
  alignas(64) float sbuf[NR][16];
  __m512 acc[NR][MR][2];
  for (int r = 0; r < NR; ++r)
    for (int m = 0; m < MR; ++m) acc[r][m][0] = acc[r][m][1] = _mm512_setzero_ps();
  for (int64_t gb = 0; gb < ng; gb += 16) {
    const int cnt = static_cast<int>(ng - gb < 16 ? ng - gb : 16);
    const __mmask16 mask = static_cast<__mmask16>((1u << cnt) - 1u);
    __m512 X[MR];
    for (int m = 0; m < MR; ++m) X[m] = _mm512_maskz_loadu_ps(mask, xs[m] + gb);
    for (int r = 0; r < NR; ++r) {
      _mm_prefetch(reinterpret_cast<const char*>(sc + r * ng + gb + PF_BYTES / 16), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(ze + r * ng + gb + PF_BYTES / 16), _MM_HINT_T0);
      const __m512 S = bf16x16(mask, sc + r * ng + gb);
      const __m512 C = _mm512_fmadd_ps(S, _mm512_set1_ps(-136.f), bf16x16(mask, ze + r * ng + gb));
      _mm512_store_ps(sbuf[r], S);
      for (int m = 0; m < MR; ++m) acc[r][m][0] = _mm512_fmadd_ps(C, X[m], acc[r][m][0]);
    }
    for (int j = 0; j < cnt; j += 2) {
      __m512bh x0[MR], x1[MR];
      for (int m = 0; m < MR; ++m) {
        x0[m] = (__m512bh)_mm512_loadu_si512(xb[m] + (gb + j) * kGroup);
        x1[m] = (__m512bh)_mm512_loadu_si512(xb[m] + (gb + j + 1) * kGroup);
      }
      for (int r = 0; r < NR; ++r) {
        _mm_prefetch(reinterpret_cast<const char*>(wq + r * rb + (gb + j) * 16 + PF_BYTES), _MM_HINT_T0);
        const __m512i b = _mm512_cvtepu8_epi16(_mm256_loadu_si256(
            reinterpret_cast<const __m256i*>(wq + r * rb + (gb + j) * 16)));
        const __m512bh w0 = (__m512bh)_mm512_ternarylogic_epi32(b, lo4, bias, 0xEA);  // (b & lo4) | bias
        const __m512bh w1 = (__m512bh)_mm512_or_si512(_mm512_srli_epi16(b, 4), bias);
        const __m512 s0 = _mm512_set1_ps(sbuf[r][j]), s1 = _mm512_set1_ps(sbuf[r][j + 1]);
        for (int m = 0; m < MR; ++m) {
          acc[r][m][0] = _mm512_fmadd_ps(_mm512_dpbf16_ps(_mm512_setzero_ps(), w0, x0[m]), s0,
                                         acc[r][m][0]);
          acc[r][m][1] = _mm512_fmadd_ps(_mm512_dpbf16_ps(_mm512_setzero_ps(), w1, x1[m]), s1,
                                         acc[r][m][1]);
        }
      }
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int m = 0; m < MR; ++m)
      out[r * MR + m] = _mm512_reduce_add_ps(_mm512_add_ps(acc[r][m][0], acc[r][m][1]));
}

// the weight against M rows of x, tile by tile (tiles.h)
void rows_simd(const uint8_t* wq, const uint16_t* sc, const uint16_t* ze, int64_t ng,
               const uint16_t* xb, const float* xs, int64_t M, int64_t K, float* y, int64_t N,
               int64_t ldy) {
  walk_tiles(M, N, y, [&](auto nr_, auto mr_, int64_t n, int64_t m0, float* o) {
    constexpr int nr = decltype(nr_)::value, mr = decltype(mr_)::value;
    const uint16_t* xr[mr];
    const float* sr[mr];
    for (int i = 0; i < mr; ++i) {
      xr[i] = xb + (m0 + i) * K;
      sr[i] = xs + (m0 + i) * ng;
    }
    tile<nr, mr>(wq + n * ng * 16, sc + n * ng, ze + n * ng, ng, xr, sr, o);
  }, ldy);
}
#elif defined(__AVX2__) && defined(__FMA__)
// AVX2 (no AVX-512: AMD Zen 2/3, older Intel): the dot products on integer lanes. A row
// of x becomes int16 codes xq = round(x / d), d = amax / 32767 (half to even): the error
// is at most 1.5e-5 of the row's largest value, against bfloat16's own rounding of that
// value, 2e-3 of it. dot(q, x_g) = d * dot(q, xq), the integer dot exact (vpmaddwd: 16
// products summed in pairs to 32 bits, at most 32 * 15 * 32767 a group), one float32
// FMA by the group's scale, d once at the end. The rest of the formula (y = sum_g
// scale_g * dot(q_g - 8, x_g) + zero_g * sum(x_g)) per output row: sum_g scale_g *
// (-8 d sum(xq_g)) + zero_g * sum(x_g), x's group sums exact
// (prep_row), 8 groups a pass. A float32 tile doing (q * scale + zero - 8 scale) * x per
// weight was compute-bound at ~3.5 GB/s of codes; this one takes about half its
// instructions. (int8 codes, as llama.cpp multiplies Q4 by Q8, take a third, but doubled
// the KL to the unquantized model: SmolLM2, 32-token windows, 0.0037 -> 0.0081.) Each
// (r, m) pair runs the same instructions in the same order whatever NR and MR are, and
// x's codes depend on its row alone.
constexpr bool kSimd = true;

struct XQ {              // one row of x, prepared: its codes and d; per group -8 d sum(xq), sum(x)
  const int16_t* q;      // per group in the weight's word order: inputs 0-7, 16-23, 8-15, 24-31
  float d;
  const float* a;
  const float* b;
};

inline int hsum8i(__m256i v) {
  const __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  const __m128i t = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  return _mm_cvtsi128_si32(_mm_add_epi32(t, _mm_shuffle_epi32(t, 0xB1)));
}

inline float hmax8(__m256 v) {
  const __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(t, _mm_movehdup_ps(t)));
}

// one row of x (its bfloat16 bits, prep_row's) -> int16 codes, d (the row's), and per
// group a = -8 d sum(xq)
float quant_row(const uint16_t* x, int64_t ng, int16_t* q, float* a) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 mx = _mm256_setzero_ps();
  for (int64_t k = 0; k < ng * kGroup; k += 8)
    mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, load8(x + k)));
  const float amax = hmax8(mx);
  const float d = amax / 32767.f;
  const __m256 id = _mm256_set1_ps(amax > 0.f ? 32767.f / amax : 0.f);
  for (int64_t g = 0; g < ng; ++g) {
    __m256i c[4];
    for (int i = 0; i < 4; ++i)   // half to even
      c[i] = _mm256_cvtps_epi32(_mm256_mul_ps(load8(x + g * kGroup + 8 * i), id));
    const int sum = hsum8i(_mm256_add_epi32(_mm256_add_epi32(c[0], c[1]), _mm256_add_epi32(c[2], c[3])));
    // packs interleave by 128-bit halves: (c0, c2) -> 0-3, 16-19 | 4-7, 20-23; 0xD8 puts
    // them in order 0-7 | 16-23, the words vpunpcklbw makes of a block's bytes
    int16_t* o = q + g * kGroup;
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(o), _mm256_permute4x64_epi64(_mm256_packs_epi32(c[0], c[2]), 0xD8));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + 16), _mm256_permute4x64_epi64(_mm256_packs_epi32(c[1], c[3]), 0xD8));
    a[g] = -8.f * d * static_cast<float>(sum);
  }
  return d;
}

// a block's group g (h = 0: the low nibbles) or g + 1 (h = 1: the high) against MR rows:
// acc[m] += float(dot(q, xq)) * scale, q decoded from the block's 32 bytes at p
template <int MR, int H>
inline void group8(const uint8_t* p, float scale, const int16_t* const* xq, int64_t off,
                   __m256 (&acc)[MR]) {
  const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  const __m256i zero = _mm256_setzero_si256();
  const __m256i bl = _mm256_unpacklo_epi8(b, zero), bh = _mm256_unpackhi_epi8(b, zero);  // bytes 0-7, 16-23 | 8-15, 24-31
  __m256i lo, hi;
  if constexpr (H == 0) {
    const __m256i lo4 = _mm256_set1_epi16(0x0F);
    lo = _mm256_and_si256(bl, lo4), hi = _mm256_and_si256(bh, lo4);
  } else {
    lo = _mm256_srli_epi16(bl, 4), hi = _mm256_srli_epi16(bh, 4);
  }
  const __m256 s = _mm256_set1_ps(scale);
  for (int m = 0; m < MR; ++m) {
    const __m256i* x = reinterpret_cast<const __m256i*>(xq[m] + off);
    const __m256i i = _mm256_add_epi32(_mm256_madd_epi16(lo, _mm256_loadu_si256(x + 2 * H)),
                                       _mm256_madd_epi16(hi, _mm256_loadu_si256(x + 2 * H + 1)));
    acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i), s, acc[m]);
  }
}

// One group at a time (the block's bytes read again for its second group, from L1): live
// are the group's two code vectors and the accumulators, so a 1 x 4 tile keeps its 8 in
// registers (both groups' codes at once spilled 3 of them to the stack).
template <int NR, int MR>
void tile(const uint8_t* wq, const uint16_t* sc, const uint16_t* ze, int64_t ng,
          const XQ* xr, float* out) {
  const int64_t rb = ng * 16;   // bytes of codes per weight row
  __m256 acc[NR][2][MR];
  const int16_t* xq[MR];
  for (int m = 0; m < MR; ++m) xq[m] = xr[m].q;
  for (int r = 0; r < NR; ++r)
    for (int m = 0; m < MR; ++m) acc[r][0][m] = acc[r][1][m] = _mm256_setzero_ps();
  for (int64_t g = 0; g < ng; g += 2) {   // a block: groups g (low nibbles) and g + 1 (high)
    for (int r = 0; r < NR; ++r) {
      const uint8_t* p = wq + r * rb + g * 16;
      _mm_prefetch(reinterpret_cast<const char*>(p + PF_BYTES), _MM_HINT_T0);
      group8<MR, 0>(p, bf16_float(sc[r * ng + g]), xq, g * kGroup, acc[r][0]);
      group8<MR, 1>(p, bf16_float(sc[r * ng + g + 1]), xq, g * kGroup, acc[r][1]);
    }
  }
  for (int r = 0; r < NR; ++r) {
    const uint16_t* s = sc + r * ng;
    const uint16_t* z = ze + r * ng;
    __m256 t[MR];   // the offset and zero terms, 8 groups a pass, the weight's read once
    for (int m = 0; m < MR; ++m) t[m] = _mm256_setzero_ps();
    int64_t g = 0;
    for (; g + 8 <= ng; g += 8) {
      const __m256 S = load8(s + g), Z = load8(z + g);
      for (int m = 0; m < MR; ++m) {
        t[m] = _mm256_fmadd_ps(S, _mm256_loadu_ps(xr[m].a + g), t[m]);
        t[m] = _mm256_fmadd_ps(Z, _mm256_loadu_ps(xr[m].b + g), t[m]);
      }
    }
    for (int m = 0; m < MR; ++m) {
      float tail = 0.f;
      for (int64_t h = g; h < ng; ++h) tail += bf16_float(s[h]) * xr[m].a[h] + bf16_float(z[h]) * xr[m].b[h];
      out[r * MR + m] = xr[m].d * hsum8(_mm256_add_ps(acc[r][0][m], acc[r][1][m])) + (hsum8(t[m]) + tail);
    }
  }
}

void rows_simd(const uint8_t* wq, const uint16_t* sc, const uint16_t* ze, int64_t ng,
               const XQ* xq, int64_t M, float* y, int64_t N, int64_t ldy) {
  walk_tiles(M, N, y, [&](auto nr_, auto mr_, int64_t n, int64_t m0, float* o) {
    constexpr int nr = decltype(nr_)::value, mr = decltype(mr_)::value;
    tile<nr, mr>(wq + n * ng * 16, sc + n * ng, ze + n * ng, ng, xq + m0, o);
  }, ldy);
}

// one weight row -> float32, each value (q - 8) * scale + zero rounded to bfloat16 (the
// values int4_dequant's bfloat16 weight holds): prefill's float32 GEMM runs on it
void dequant_row_f32(const uint8_t* wq, const uint16_t* sc, const uint16_t* ze, int64_t ng,
                     float* out) {
  const __m256i lo4 = _mm256_set1_epi32(0x0F), one = _mm256_set1_epi32(1);
  const __m256i bias = _mm256_set1_epi32(0x7FFF), hi16 = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  auto round = [&](__m256 v) {   // to bfloat16, half to even (bf16_bits; no NaN here)
    const __m256i b = _mm256_castps_si256(v);
    const __m256i r = _mm256_add_epi32(_mm256_add_epi32(b, bias),
                                       _mm256_and_si256(_mm256_srli_epi32(b, 16), one));
    return _mm256_castsi256_ps(_mm256_and_si256(r, hi16));
  };
  for (int64_t g = 0; g < ng; g += 2) {
    const __m256 s0 = _mm256_set1_ps(bf16_float(sc[g])), z0 = _mm256_set1_ps(bf16_float(ze[g]));
    const __m256 s1 = _mm256_set1_ps(bf16_float(sc[g + 1])), z1 = _mm256_set1_ps(bf16_float(ze[g + 1]));
    const __m256 eight = _mm256_set1_ps(8.f);
    for (int c = 0; c < 4; ++c) {
      const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(wq + g * 16 + 8 * c)));
      const __m256 q0 = _mm256_sub_ps(_mm256_cvtepi32_ps(_mm256_and_si256(b, lo4)), eight);
      const __m256 q1 = _mm256_sub_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4)), eight);
      _mm256_storeu_ps(out + g * kGroup + 8 * c, round(_mm256_add_ps(_mm256_mul_ps(q0, s0), z0)));
      _mm256_storeu_ps(out + (g + 1) * kGroup + 8 * c, round(_mm256_add_ps(_mm256_mul_ps(q1, s1), z1)));
    }
  }
}
#else
constexpr bool kSimd = false;
#endif

template <typename T>
void gemv_kernel(const T* x, int64_t M, int64_t K, const uint8_t* wq, const uint16_t* sc,
                 const uint16_t* ze, int64_t N, T* y) {
  const int64_t ng = K / kGroup;
  thread_local std::vector<uint16_t> xb;
  thread_local std::vector<float> xs, yf;
  xb.resize(M * K);
  xs.resize(M * ng);
  for (int64_t m = 0; m < M; ++m) prep_row(x + m * K, K, xb.data() + m * K, xs.data() + m * ng);
  float* out = reinterpret_cast<float*>(y);
  if constexpr (!std::is_same_v<T, float>) {
    yf.resize(M * N);
    out = yf.data();
  }
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
  // on the helper thread too when on (decode at one or two sequences reads the weight at two
  // cores' bandwidth)
  const uint16_t* xbp = xb.data();   // (xb, xs: this thread's; the helper has its own)
  const float* xsp = xs.data();
  over_spans(N, [=](int64_t n0, int64_t n) {
    rows_simd(wq + n0 * ng * 16, sc + n0 * ng, ze + n0 * ng, ng, xbp, xsp, M, K, out + n0, n, N);
  });
#elif defined(__AVX2__) && defined(__FMA__)
  thread_local std::vector<float> xa;   // per group a
  thread_local std::vector<int16_t> xq;
  thread_local std::vector<XQ> rows;
  xq.resize(M * K);
  xa.resize(M * ng);
  rows.resize(M);
  for (int64_t m = 0; m < M; ++m) {
    const float d = quant_row(xb.data() + m * K, ng, xq.data() + m * K, xa.data() + m * ng);
    rows[m] = XQ{xq.data() + m * K, d, xa.data() + m * ng, xs.data() + m * ng};
  }
  const XQ* rp = rows.data();   // on the helper too when on, as above (rows: this thread's)
  over_spans(N, [=](int64_t n0, int64_t n) {
    rows_simd(wq + n0 * ng * 16, sc + n0 * ng, ze + n0 * ng, ng, rp, M, out + n0, n, N);
  });
#else
  TORCH_CHECK(false, "int4_gemv: built without AVX512-BF16 or AVX2 (int4_simd() is false)");
#endif
  if constexpr (!std::is_same_v<T, float>)
    for (int64_t i = 0; i < M * N; ++i) y[i] = T(bf16_bits(out[i]), T::from_bits());
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
// 16 codes (16-bit lanes of v, from word `half` * 16 on) -> (q - 8) * scale + zero, rounded
inline __m256i dequant16(__m512i v, int half, __m512 s, __m512 z) {
  const __m256i h = half ? _mm512_extracti64x4_epi64(v, 1) : _mm512_castsi512_si256(v);
  const __m512 q = _mm512_sub_ps(_mm512_cvtepi32_ps(_mm512_cvtepu16_epi32(h)), _mm512_set1_ps(8.f));
  return (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(_mm512_mul_ps(q, s), z));
}

// one weight row -> bfloat16: w = (q - 8) * scale + zero in float32 (a product, then a
// sum, as the torch reference computes it), rounded to nearest even
void dequant_row(const uint8_t* wq, const uint16_t* sc, const uint16_t* ze, int64_t ng,
                 uint16_t* out) {
  for (int64_t g = 0; g < ng; g += 2) {
    const __m512i b = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wq + g * 16)));
    const __m512i codes[2] = {_mm512_and_si512(b, _mm512_set1_epi16(0x000F)), _mm512_srli_epi16(b, 4)};
    for (int h = 0; h < 2; ++h) {
      const __m512 s = _mm512_set1_ps(bf16_float(sc[g + h])), z = _mm512_set1_ps(bf16_float(ze[g + h]));
      uint16_t* o = out + (g + h) * kGroup;
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(o), dequant16(codes[h], 0, s, z));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + 16), dequant16(codes[h], 1, s, z));
    }
  }
}
#endif

}  // namespace

bool int4_simd() { return kSimd; }

// x [M, K] float32 | bfloat16 -> [M, N] in x's dtype
at::Tensor int4_gemv(const at::Tensor& x, const at::Tensor& codes,
                     const at::Tensor& scale, const at::Tensor& zero) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && !x.is_cuda(), "int4_gemv: x [M, K] contiguous CPU");
  const int64_t M = x.size(0), K = x.size(1), N = codes.size(0);
  TORCH_CHECK(K % 64 == 0 && codes.size(1) == K / 2 && codes.scalar_type() == at::kByte &&
                  codes.is_contiguous(), "int4_gemv: codes [N, K/2] uint8, K a multiple of 64");
  for (const auto* t : {&scale, &zero})
    TORCH_CHECK(t->scalar_type() == at::kBFloat16 && t->is_contiguous() && t->size(0) == N &&
                    t->size(1) == K / kGroup, "int4_gemv: scale, zero [N, K/32] bfloat16");
  auto y = at::empty({M, N}, x.options());
  const auto* wq = codes.data_ptr<uint8_t>();
  const auto* sc = reinterpret_cast<const uint16_t*>(scale.data_ptr<at::BFloat16>());
  const auto* ze = reinterpret_cast<const uint16_t*>(zero.data_ptr<at::BFloat16>());
  pybind11::gil_scoped_release_simple nogil;  // the engine thread's matmul; the event loop runs on
  if (x.scalar_type() == at::kBFloat16)
    gemv_kernel(x.data_ptr<at::BFloat16>(), M, K, wq, sc, ze, N, y.data_ptr<at::BFloat16>());
  else if (x.scalar_type() == at::kFloat)
    gemv_kernel(x.data_ptr<float>(), M, K, wq, sc, ze, N, y.data_ptr<float>());
  else
    TORCH_CHECK(false, "int4_gemv: x float32 or bfloat16");
  return y;
}

// the weight as bfloat16 [N, K] (prefill's GEMM runs on it: oneDNN's bfloat16 GEMM is 2-3x
// the int4 kernel's speed from 8 rows on, and dequantizing costs one pass)
at::Tensor int4_dequant(const at::Tensor& codes, const at::Tensor& scale,
                        const at::Tensor& zero, const c10::optional<at::Tensor>& into) {
  const int64_t N = codes.size(0), K = codes.size(1) * 2, ng = K / kGroup;
  TORCH_CHECK(K % 64 == 0 && codes.scalar_type() == at::kByte && codes.is_contiguous(),
              "int4_dequant: codes [N, K/2] uint8, K a multiple of 64");
  for (const auto* t : {&scale, &zero})
    TORCH_CHECK(t->scalar_type() == at::kBFloat16 && t->is_contiguous() && t->size(0) == N &&
                    t->size(1) == ng, "int4_dequant: scale, zero [N, K/32] bfloat16");
  // into: a bfloat16 buffer of at least N * K elements to write to (a buffer kept across
  // calls saves the page faults of a fresh multi-MB allocation, ~0.2 ms on gate|up)
  // (AVX2: into float32, the same values; bfloat16 GEMMs are slow there)
  at::Tensor w;
  if (into.has_value()) {
    TORCH_CHECK((into->scalar_type() == at::kBFloat16 || into->scalar_type() == at::kFloat) &&
                    into->is_contiguous() && into->numel() >= N * K,
                "int4_dequant: into, bfloat16 or float32 of N * K or more");
    w = into->view(-1).narrow(0, 0, N * K).view({N, K});
  } else {
    w = at::empty({N, K}, scale.options());
  }
  const auto* wq = codes.data_ptr<uint8_t>();
  const auto* sc = reinterpret_cast<const uint16_t*>(scale.data_ptr<at::BFloat16>());
  const auto* ze = reinterpret_cast<const uint16_t*>(zero.data_ptr<at::BFloat16>());
  pybind11::gil_scoped_release_simple nogil;
  if (w.scalar_type() == at::kFloat) {
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512BF16__)
    float* outf = w.data_ptr<float>();
    for (int64_t n = 0; n < N; ++n)
      dequant_row_f32(wq + n * (K / 2), sc + n * ng, ze + n * ng, ng, outf + n * K);
    return w;
#else
    TORCH_CHECK(false, "int4_dequant: float32 only on an AVX2 build");
#endif
  }
  auto* out = reinterpret_cast<uint16_t*>(w.data_ptr<at::BFloat16>());
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
  for (int64_t n = 0; n < N; ++n)
    dequant_row(wq + n * (K / 2), sc + n * ng, ze + n * ng, ng, out + n * K);
#elif defined(__AVX2__) && defined(__FMA__)
  std::vector<float> row(K);   // the float32 row's values are bfloat16 already: their bits
  for (int64_t n = 0; n < N; ++n) {
    dequant_row_f32(wq + n * (K / 2), sc + n * ng, ze + n * ng, ng, row.data());
    for (int64_t k = 0; k < K; ++k) out[n * K + k] = bf16_bits(row[k]);
  }
#else
  TORCH_CHECK(false, "int4_dequant: built without AVX512-BF16 or AVX2 (int4_simd() is false)");
#endif
  return w;
}
