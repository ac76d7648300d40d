// x @ w.T for an int8 weight (per output channel scales) at a few rows: the LM head of a
// decode step, SmolLM2's largest single weight (28 MB), read once from memory. And, with
// the same 8-lane tile, float_gemv: a plain float32 or bfloat16 weight in deterministic
// mode (below).
//
// The weight as Int8Weight keeps it (shared/engine/quant.py): q [N, K] int8, scale [N]
// (float32 or bfloat16). y[m, n] = scale[n] * dot(q[n], x[m]) with x rounded to bfloat16
// first (as torch's _weight_int8pack_mm takes it), the dot in float32 (16 lanes, two
// accumulators by chunk parity, summed at the end). Each (row, output) pair runs the same
// instructions in the same order at any row count: a row's logits do not depend on its
// batch. On AVX2 the same with 8 lanes (other bits than AVX-512's, as batch-invariant).
// Built without either, int8_simd() is false and the Python side keeps torch's.
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

#if (defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)) || \
    (defined(__AVX2__) && defined(__FMA__))
#define SIMD8 1   // a tile8 below: AVX-512 or AVX2
#else
#define SIMD8 0
#endif
constexpr bool kSimd8 = SIMD8;

#ifndef PF_BYTES8
#define PF_BYTES8 4096   // software prefetch distance (bytes), as int4_gemv.cpp measured
#endif

// weight rows [0, N) of q [N, K] against x [M, K] into y (rows ldy apart): walk_tiles'
// register tiles, each by tile(Int<NR>, Int<MR>, the tile's first weight row, K, its rows
// of x, out)
template <typename W, typename Tile>
void walk_rows(const W* q, int64_t N, int64_t K, const float* xf, int64_t M, float* y,
               int64_t ldy, Tile tile) {
  walk_tiles(M, N, y, [&](auto nr_, auto mr_, int64_t n, int64_t m0, float* o) {
    constexpr int mr = decltype(mr_)::value;
    const float* xr[mr];
    for (int i = 0; i < mr; ++i) xr[i] = xf + (m0 + i) * K;
    tile(nr_, mr_, q + n * K, K, xr, o);
  }, ldy);
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
template <int NR, int MR>
void tile8(const int8_t* q, int64_t K, const float* const* xf, float* out) {
  __m512 acc[NR][MR][2];
  for (int r = 0; r < NR; ++r)
    for (int m = 0; m < MR; ++m) acc[r][m][0] = acc[r][m][1] = _mm512_setzero_ps();
  for (int64_t k = 0, c = 0; k < K; k += 16, ++c) {
    const __mmask16 mask = K - k >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (K - k)) - 1u);
    __m512 X[MR];
    for (int m = 0; m < MR; ++m) X[m] = _mm512_maskz_loadu_ps(mask, xf[m] + k);
    for (int r = 0; r < NR; ++r) {
      const int8_t* p = q + r * K + k;
      _mm_prefetch(reinterpret_cast<const char*>(p + PF_BYTES8), _MM_HINT_T0);
      const __m512 w = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(mask, p)));
      for (int m = 0; m < MR; ++m) acc[r][m][c & 1] = _mm512_fmadd_ps(w, X[m], acc[r][m][c & 1]);
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int m = 0; m < MR; ++m)
      out[r * MR + m] = _mm512_reduce_add_ps(_mm512_add_ps(acc[r][m][0], acc[r][m][1]));
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
// 8 lanes (AVX2, and AVX-512 builds too): AVX2 CPUs' int8 tile (no AVX-512: AMD Zen 2/3,
// older Intel; torch's _weight_int8pack_mm there was 7.3 ms for SmolLM2's head at one row
// and 46 ms at 16), and float_gemv's on every CPU. A weight of int8, float32 or bfloat16
// (uint16 bits) widened to float32 8 at a time; the same walk and the same two
// accumulators by chunk parity.
inline __m256 widen8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline __m256 widen8(const float* p) { return load8(p); }
inline __m256 widen8(const uint16_t* p) { return load8(p); }

// one chunk of 8 inputs: acc[.][.][A] += w[r][k..k+8) * x[m][k..k+8) (A: the chunk's parity)
template <int NR, int MR, int A, typename W>
inline void chunk8(const W* const* w, const float* const* x, int64_t k,
                   __m256 (&acc)[NR][MR][2]) {
  __m256 X[MR];
  for (int m = 0; m < MR; ++m) X[m] = _mm256_loadu_ps(x[m] + k);
  for (int r = 0; r < NR; ++r) {
    const __m256 wf = widen8(w[r] + k);
    for (int m = 0; m < MR; ++m) acc[r][m][A] = _mm256_fmadd_ps(wf, X[m], acc[r][m][A]);
  }
}

template <int NR, int MR, typename W>
void lanes8_tile(const W* q, int64_t K, const float* const* xf, float* out) {
  __m256 acc[NR][MR][2];
  for (int r = 0; r < NR; ++r)
    for (int m = 0; m < MR; ++m) acc[r][m][0] = acc[r][m][1] = _mm256_setzero_ps();
  // the rows' pointers fixed, k the one index (pointers moved in arrays, gcc vectorized
  // their arithmetic: ~9 instructions in each pass of 16 inputs)
  const W* w[NR];
  const float* x[MR];
  for (int r = 0; r < NR; ++r) w[r] = q + r * K;
  for (int m = 0; m < MR; ++m) x[m] = xf[m];
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {   // two chunks a pass: the parity fixed, acc in registers
    if ((k & 63) == 0)
      for (int r = 0; r < NR; ++r)
        _mm_prefetch(reinterpret_cast<const char*>(w[r] + k) + PF_BYTES8, _MM_HINT_T0);
    chunk8<NR, MR, 0>(w, x, k, acc);
    chunk8<NR, MR, 1>(w, x, k + 8, acc);
  }
  for (int a = 0; k < K; k += 8, ++a) {   // the last inputs (fewer than 16), zero-padded
    const int64_t n = K - k < 8 ? K - k : 8;
    alignas(32) W wt[NR][8] = {};
    alignas(32) float xt[MR][8] = {};
    const W* wp[NR];
    const float* xp[MR];
    for (int r = 0; r < NR; ++r) {
      std::memcpy(wt[r], w[r] + k, n * sizeof(W));
      wp[r] = wt[r];
    }
    for (int m = 0; m < MR; ++m) {
      std::memcpy(xt[m], x[m] + k, n * sizeof(float));
      xp[m] = xt[m];
    }
    if (a == 0) chunk8<NR, MR, 0>(wp, xp, 0, acc);
    else chunk8<NR, MR, 1>(wp, xp, 0, acc);
  }
  for (int r = 0; r < NR; ++r)
    for (int m = 0; m < MR; ++m) out[r * MR + m] = hsum8(_mm256_add_ps(acc[r][m][0], acc[r][m][1]));
}

#endif

#if !(defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)) && \
    defined(__AVX2__) && defined(__FMA__)
template <int NR, int MR>
void tile8(const int8_t* q, int64_t K, const float* const* xf, float* out) {
  lanes8_tile<NR, MR>(q, K, xf, out);
}
#endif

#if SIMD8
// weight rows [0, N) into y (rows ldy apart)
void rows8(const int8_t* q, int64_t N, int64_t K, const float* xf, int64_t M, float* y,
           int64_t ldy) {
  walk_rows(q, N, K, xf, M, y, ldy, [](auto nr, auto mr, const int8_t* w, int64_t k,
                                       const float* const* xr, float* o) {
    tile8<decltype(nr)::value, decltype(mr)::value>(w, k, xr, o);
  });
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
template <typename W>
void float_rows8(const W* q, int64_t N, int64_t K, const float* xf, int64_t M, float* y,
                 int64_t ldy) {
  walk_rows(q, N, K, xf, M, y, ldy, [](auto nr, auto mr, const W* w, int64_t k,
                                       const float* const* xr, float* o) {
    lanes8_tile<decltype(nr)::value, decltype(mr)::value>(w, k, xr, o);
  });
}
#endif

}  // namespace

bool int8_simd() { return kSimd8; }

// x [M, K] float32 | bfloat16, q [N, K] int8, scale [N] float32 | bfloat16 -> [M, N] in
// x's dtype
at::Tensor int8_gemv(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale) {
  TORCH_CHECK(kSimd8, "int8_gemv: built without AVX-512 or AVX2 (int8_simd() is false)");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && !x.is_cuda(), "int8_gemv: x [M, K] contiguous CPU");
  const int64_t M = x.size(0), K = x.size(1), N = q.size(0);
  TORCH_CHECK(q.scalar_type() == at::kChar && q.is_contiguous() && q.size(1) == K,
              "int8_gemv: q [N, K] int8 contiguous");
  TORCH_CHECK(scale.numel() == N, "int8_gemv: scale [N]");
  const auto sf = scale.to(at::kFloat).contiguous();
  const auto xb = x.to(at::kBFloat16).to(at::kFloat).contiguous();
  auto yf = at::empty({M, N}, x.options().dtype(at::kFloat));
#if SIMD8
  {
    pybind11::gil_scoped_release_simple nogil;
    float* y = yf.data_ptr<float>();
    const int8_t* qp = q.data_ptr<int8_t>();
    const float* xp = xb.data_ptr<float>();
    // on the helper thread too when on (helper.h): spans of weight rows, each row's
    // instructions the same on either thread
    over_spans(N, [=](int64_t n0, int64_t n) { rows8(qp + n0 * K, n, K, xp, M, y + n0, N); });
    const float* s = sf.data_ptr<float>();
    for (int64_t m = 0; m < M; ++m)
      for (int64_t n = 0; n < N; ++n) y[m * N + n] *= s[n];
  }
#endif
  return x.scalar_type() == at::kFloat ? yf : yf.to(x.scalar_type());
}

bool float_simd() {
#if defined(__AVX2__) && defined(__FMA__)
  return true;
#else
  return false;
#endif
}

// x [M, K] @ w [N, K].T for a plain float32 or bfloat16 weight, x float32 | bfloat16 (taken
// exactly, in float32) -> [M, N] in x's dtype: each (row, output) pair the same
// instructions in the same order at any row count and on either thread (deterministic
// mode's matmul: a row's bits do not depend on its batch, at the cost of its own rows).
at::Tensor float_gemv(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(float_simd(), "float_gemv: built without AVX2 and FMA (float_simd() is false)");
  TORCH_CHECK(x.dim() == 2 && !x.is_cuda(), "float_gemv: x [M, K] on the CPU");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous() && w.size(1) == K &&
                  (w.scalar_type() == at::kFloat || w.scalar_type() == at::kBFloat16),
              "float_gemv: w [N, K] float32 | bfloat16 contiguous");
  const auto xf = x.to(at::kFloat).contiguous();
  auto yf = at::empty({M, N}, x.options().dtype(at::kFloat));
#if defined(__AVX2__) && defined(__FMA__)
  {
    pybind11::gil_scoped_release_simple nogil;
    float* y = yf.data_ptr<float>();
    const float* xp = xf.data_ptr<float>();
    if (w.scalar_type() == at::kFloat) {
      const float* wp = w.data_ptr<float>();
      over_spans(N, [=](int64_t n0, int64_t n) { float_rows8(wp + n0 * K, n, K, xp, M, y + n0, N); });
    } else {
      const uint16_t* wp = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
      over_spans(N, [=](int64_t n0, int64_t n) { float_rows8(wp + n0 * K, n, K, xp, M, y + n0, N); });
    }
  }
#endif
  return x.scalar_type() == at::kFloat ? yf : yf.to(x.scalar_type());
}
