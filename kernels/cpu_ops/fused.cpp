// A decode step's small elementwise passes, one call each instead of four torch ops: at one
// row the ops' own overhead is the cost (SmolLM2, one row: the RMSNorm's four ops 16 us,
// RoPE's four 11 us, against ~2-3 us for one call here; 61 norms and 30 RoPEs a token).
//
// rms_norm: Model.rms_norm's arithmetic: n = x * (1 / sqrt(mean(x^2) + eps)) in float32,
//   then w * n rounded to x's dtype as torch rounds each op (n to x's dtype first, then the
//   product), or for Gemma n * w in float32, rounded once. The mean's sum runs in 16
//   lanes, not in torch's order: results are within a float32 rounding of torch's (tests).
// silu_mul: Model.mlp's silu(gate) * up of gate|up [T, 2I]: silu in float32 (x / (1 +
//   exp(-x))) rounded to x's dtype, then the product rounded: torch's two ops, up to the
//   last float32 bit of exp (simd.h's exp16 or exp8 here, SLEEF's in torch).
// rope: Model.rope's x * cos + rot(x) * sin with sin's sign folded in, rot the halves'
//   swap (or, interleaved, the pairs' swap), each product and the sum rounded to x's dtype
//   as torch's ops round them: the same bits as the torch expression.
#include "aten.h"
#include <immintrin.h>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "bf16.h"
#include "simd.h"
#include "lanes8.h"

namespace {

inline float f32(float v) { return v; }
inline float f32(c10::BFloat16 v) { return bf16_float(v.x); }
template <typename T> inline T to(float f);
template <> inline float to<float>(float f) { return f; }
template <> inline c10::BFloat16 to<c10::BFloat16>(float f) {
  return c10::BFloat16(bf16_bits(f), c10::BFloat16::from_bits());
}
template <typename T> inline float rnd(float f) { return f32(to<T>(f)); }   // f in T's precision


template <typename T, typename W>
void norm_rows(const T* x, const W* w, int64_t rows, int64_t H, float eps, bool gemma, T* y) {
  for (int64_t t = 0; t < rows; ++t) {
    const T* xr = x + t * H;
    float lanes[16] = {};
    int64_t i = 0;
    for (; i + 16 <= H; i += 16)
      for (int l = 0; l < 16; ++l) lanes[l] += f32(xr[i + l]) * f32(xr[i + l]);
    for (; i < H; ++i) lanes[i % 16] += f32(xr[i]) * f32(xr[i]);
    float ss = 0.f;
    for (int l = 0; l < 16; ++l) ss += lanes[l];
    const float r = 1.f / std::sqrt(ss / static_cast<float>(H) + eps);
    T* yr = y + t * H;
    if (gemma)
      for (i = 0; i < H; ++i) yr[i] = to<T>(f32(xr[i]) * r * f32(w[i]));
    else
      for (i = 0; i < H; ++i) yr[i] = to<T>(f32(w[i]) * rnd<T>(f32(xr[i]) * r));
  }
}

template <typename T>
void rope_rows(const T* x, int64_t s_t, int64_t s_h, int64_t rows, int64_t heads, int64_t D,
               const T* cos, const T* sin, bool interleaved, T* y) {
  const int64_t half = D / 2;
  for (int64_t t = 0; t < rows; ++t) {
    const T* c = cos + t * D;
    const T* s = sin + t * D;
    for (int64_t h = 0; h < heads; ++h) {
      const T* xr = x + t * s_t + h * s_h;
      T* yr = y + (t * heads + h) * D;
      auto one = [&](int64_t d, int64_t p) {
        yr[d] = to<T>(rnd<T>(f32(xr[d]) * f32(c[d])) + rnd<T>(f32(xr[p]) * f32(s[d])));
      };
      if (interleaved) {
        for (int64_t d = 0; d < D; ++d) one(d, d ^ 1);
      } else {   // the halves' loops apart: each vectorizes (one with a partner per element did not)
        for (int64_t d = 0; d < half; ++d) one(d, d + half);
        for (int64_t d = half; d < D; ++d) one(d, d - half);
      }
    }
  }
}

template <typename T>
void silu_mul_rows(const T* x, int64_t rows, int64_t I, T* y) {
  for (int64_t t = 0; t < rows; ++t) {
    const T* g = x + t * 2 * I;
    const T* u = g + I;
    T* yr = y + t * I;
    int64_t i = 0;
#if defined(__AVX512F__)
    alignas(64) float e[16];
    for (; i + 16 <= I; i += 16) {   // the exps 16 at a time; the rest as below
      for (int l = 0; l < 16; ++l) e[l] = -f32(g[i + l]);
      _mm512_store_ps(e, exp16(_mm512_load_ps(e)));
      for (int l = 0; l < 16; ++l) {
        const float x = f32(g[i + l]);
        yr[i + l] = to<T>(rnd<T>(x / (1.f + e[l])) * f32(u[i + l]));
      }
    }
#elif defined(__AVX2__) && defined(__FMA__)
    for (; i + 8 <= I; i += 8) {     // 8 at a time, the same arithmetic as below; the rest as below
      const __m256 x = ld8(g + i);
      const __m256 s = rnd8<T>(_mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1.f),
                                                              exp8(_mm256_sub_ps(_mm256_setzero_ps(), x)))));
      st8(yr + i, rnd8<T>(_mm256_mul_ps(s, ld8(u + i))));
    }
#endif
    for (; i < I; ++i) {
      const float v = f32(g[i]);
      yr[i] = to<T>(rnd<T>(v / (1.f + std::exp(-v))) * f32(u[i]));
    }
  }
}

}  // namespace

// gate|up [T, 2I] contiguous float32 | bfloat16 -> [T, I]
at::Tensor silu_mul(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.size(1) % 2 == 0,
              "silu_mul: gate|up [T, 2I] contiguous");
  auto y = at::empty({x.size(0), x.size(1) / 2}, x.options());
  if (x.scalar_type() == at::kBFloat16)
    silu_mul_rows(x.data_ptr<at::BFloat16>(), x.size(0), x.size(1) / 2, y.data_ptr<at::BFloat16>());
  else if (x.scalar_type() == at::kFloat)
    silu_mul_rows(x.data_ptr<float>(), x.size(0), x.size(1) / 2, y.data_ptr<float>());
  else
    TORCH_CHECK(false, "silu_mul: float32 or bfloat16");
  return y;
}

// x [T, H] contiguous float32 | bfloat16; w [H] x's dtype or float32 (Gemma's 1 + w)
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps, bool gemma) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && w.is_contiguous() && w.numel() == x.size(1),
              "rms_norm: x [T, H] contiguous, w [H]");
  auto y = at::empty_like(x);
  const int64_t T = x.size(0), H = x.size(1);
  const float e = static_cast<float>(eps);
  if (x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16)
    norm_rows(x.data_ptr<at::BFloat16>(), w.data_ptr<at::BFloat16>(), T, H, e, gemma,
              y.data_ptr<at::BFloat16>());
  else if (x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kFloat)
    norm_rows(x.data_ptr<at::BFloat16>(), w.data_ptr<float>(), T, H, e, gemma,
              y.data_ptr<at::BFloat16>());
  else if (x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat)
    norm_rows(x.data_ptr<float>(), w.data_ptr<float>(), T, H, e, gemma, y.data_ptr<float>());
  else
    TORCH_CHECK(false, "rms_norm: float32 or bfloat16");
  return y;
}

// x [T, heads, D] (its last dim contiguous), cos/sin [T, 1, D] contiguous, x's dtype
at::Tensor rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                bool interleaved) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && cos.is_contiguous() && sin.is_contiguous() &&
                  cos.numel() == x.size(0) * x.size(2) && sin.numel() == cos.numel() &&
                  cos.scalar_type() == x.scalar_type() && sin.scalar_type() == x.scalar_type() &&
                  x.size(2) % 2 == 0, "rope: x [T, heads, D], cos/sin [T, 1, D] of x's dtype");
  auto y = at::empty({x.size(0), x.size(1), x.size(2)}, x.options());
  if (x.scalar_type() == at::kBFloat16)
    rope_rows(x.data_ptr<at::BFloat16>(), x.stride(0), x.stride(1), x.size(0), x.size(1), x.size(2),
              cos.data_ptr<at::BFloat16>(), sin.data_ptr<at::BFloat16>(), interleaved,
              y.data_ptr<at::BFloat16>());
  else if (x.scalar_type() == at::kFloat)
    rope_rows(x.data_ptr<float>(), x.stride(0), x.stride(1), x.size(0), x.size(1), x.size(2),
              cos.data_ptr<float>(), sin.data_ptr<float>(), interleaved, y.data_ptr<float>());
  else
    TORCH_CHECK(false, "rope: float32 or bfloat16");
  return y;
}
