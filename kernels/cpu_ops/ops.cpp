// CPU ops in C++ where torch takes several passes over memory for one: the activation
// side of a W8A8 GEMM (one pass each way) and decode attention read in place.
//
// quant_rows: x [M, K] (float32 | bfloat16 | float16), optionally times a per-channel
//   factor (SmoothQuant's 1/s, in x's dtype, the product rounded to x's dtype as torch's
//   `x * inv` does) -> int8 codes and one float32 scale per row (symmetric, amax / 127,
//   round half to even, clamp to +-127); u8: each code + 128 as uint8, the activations
//   of oneDNN's u8s8 qlinear with zero point 128.
// dequant_rows: the GEMM result [M, N] (int32, or its exact float32 from oneDNN) times
//   sx[m] * sw[n] (float32, in that order) -> x's dtype.
// These two are the same arithmetic as the torch reference in ref.py, element by element, so
// the results are bit for bit the same; only the ~10 passes over memory become one.
#include "aten.h"
#include <cmath>
#include <cstring>
#include <algorithm>
#include <vector>
#include <tuple>
#include <type_traits>
#include <immintrin.h>

#include "bf16.h"
#include "simd.h"
#include "lanes8.h"
#include "tiles.h"

namespace {

// float <-> element conversions that vectorize: bfloat16 by its bits (round half to even,
// as c10::BFloat16 rounds; NaN stays NaN), the rest by their own casts
template <typename T> inline float to_f(T v) { return static_cast<float>(v); }
template <typename T> inline T from_f(float f) { return static_cast<T>(f); }
template <> inline float to_f(c10::BFloat16 v) { return bf16_float(v.x); }
template <> inline c10::BFloat16 from_f(float f) {
  return c10::BFloat16(bf16_bits(f), c10::BFloat16::from_bits());
}

// one row: codes and scale (loops written so that gcc vectorizes them: restrict pointers,
// ternary clamps)
template <typename T, typename Q>
float quant_row(const T* __restrict row, const T* __restrict inv, int64_t K,
                float* __restrict b, Q* __restrict qr) {
  for (int64_t k = 0; k < K; ++k) b[k] = to_f(row[k]);
  if (inv) {
    for (int64_t k = 0; k < K; ++k) b[k] = to_f(from_f<T>(b[k] * to_f(inv[k])));
  }
  // max |b| on the bits: for floats without their sign, integer order is float order (a
  // NaN's bits are above infinity's, so a NaN row stays NaN, as torch's amax); an integer
  // max reduction vectorizes where a float one does not
  uint32_t abits = 0;
  for (int64_t k = 0; k < K; ++k) {
    uint32_t u;
    std::memcpy(&u, b + k, 4);
    u &= 0x7FFFFFFFu;
    abits = u > abits ? u : abits;
  }
  float amax;
  std::memcpy(&amax, &abits, 4);
  const float s = (amax > 1e-8f || amax != amax ? amax : 1e-8f) / 127.0f;
  for (int64_t k = 0; k < K; ++k) {
    // |b / s| <= 127 (+ rounding): adding and taking away 1.5 * 2^23 rounds half to
    // even, as torch.round does
    float r = (b[k] / s + 12582912.0f) - 12582912.0f;
    r = r < -127.f ? -127.f : (r > 127.f ? 127.f : r);
    // uint8: the code + 128 (oneDNN's u8 activations with zero point 128)
    qr[k] = static_cast<Q>(static_cast<int32_t>(r) + (std::is_same_v<Q, uint8_t> ? 128 : 0));
  }
  return s;
}

template <typename T, typename Q>
void quant_kernel(const T* x, const T* inv, int64_t M, int64_t K, Q* q, float* sx) {
  at::parallel_for(0, M, 1, [&](int64_t m0, int64_t m1) {
    std::vector<float> buf(K);
    for (int64_t m = m0; m < m1; ++m) sx[m] = quant_row(x + m * K, inv, K, buf.data(), q + m * K);
  });
}

template <typename A, typename T>
void dequant_row(const A* __restrict ar, float a, const float* __restrict sw, int64_t N,
                 T* __restrict o) {
  for (int64_t n = 0; n < N; ++n) o[n] = from_f<T>(static_cast<float>(ar[n]) * (a * sw[n]));
}

template <typename A, typename T>
void dequant_kernel(const A* acc, const float* sx, const float* sw, int64_t M,
                    int64_t N, T* out) {
  at::parallel_for(0, M, 1, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) dequant_row(acc + m * N, sx[m], sw, N, out + m * N);
  });
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> quant_rows(const at::Tensor& x,
                                                    const c10::optional<at::Tensor>& inv,
                                                    bool u8) {
  TORCH_CHECK(x.dim() == 2 && x.device().is_cpu(), "quant_rows: x must be a 2-D CPU tensor");
  auto xc = x.contiguous();
  const int64_t M = xc.size(0), K = xc.size(1);
  at::Tensor invc;
  if (inv.has_value()) {
    invc = inv->to(xc.scalar_type()).contiguous();
    TORCH_CHECK(invc.dim() == 1 && invc.size(0) == K, "quant_rows: inv must be [K]");
  }
  auto q = at::empty({M, K}, xc.options().dtype(u8 ? at::kByte : at::kChar));
  auto sx = at::empty({M, 1}, xc.options().dtype(at::kFloat));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, xc.scalar_type(), "quant_rows", [&] {
    const scalar_t* iv = invc.defined() ? invc.data_ptr<scalar_t>() : nullptr;
    if (u8)
      quant_kernel(xc.data_ptr<scalar_t>(), iv, M, K, q.data_ptr<uint8_t>(), sx.data_ptr<float>());
    else
      quant_kernel(xc.data_ptr<scalar_t>(), iv, M, K, q.data_ptr<int8_t>(), sx.data_ptr<float>());
  });
  return {q, sx};
}

at::Tensor dequant_rows(const at::Tensor& acc, const at::Tensor& sx,
                        const at::Tensor& sw, at::ScalarType dtype) {
  TORCH_CHECK(acc.dim() == 2 && (acc.scalar_type() == at::kInt ||
                                 acc.scalar_type() == at::kFloat),
              "dequant_rows: acc int32 or float32 [M, N]");
  TORCH_CHECK(sx.scalar_type() == at::kFloat && sw.scalar_type() == at::kFloat,
              "dequant_rows: float32 scales");
  auto ac = acc.contiguous(), sxc = sx.contiguous(), swc = sw.contiguous();
  const int64_t M = ac.size(0), N = ac.size(1);
  TORCH_CHECK(sxc.numel() == M && swc.numel() == N, "dequant_rows: scales of [M] and [N]");
  auto out = at::empty({M, N}, ac.options().dtype(dtype));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, dtype, "dequant_rows", [&] {
    if (ac.scalar_type() == at::kInt)
      dequant_kernel(ac.data_ptr<int32_t>(), sxc.data_ptr<float>(), swc.data_ptr<float>(), M, N,
                     out.data_ptr<scalar_t>());
    else
      dequant_kernel(ac.data_ptr<float>(), sxc.data_ptr<float>(), swc.data_ptr<float>(), M, N,
                     out.data_ptr<scalar_t>());
  });
  return out;
}

// ---- decode attention -------------------------------------------------------------------
// One query row per sequence attends over its context, read in place from the paged cache
// (no gather, no float copy): per kv head, the G query heads that share it take their
// scores from each K row once, a float32 softmax, and the weighted sum of V rows. Float32
// throughout; sums in 16 lanes (so they vectorize) then added up, so the result differs
// from torch's bmm path in the last bits, not more (tests: 1e-5 float32, 2e-2 bfloat16).

namespace {

constexpr int LANES = 16;

inline float dot(const float* __restrict q, const float* __restrict k, int64_t D) {
  float acc[LANES] = {0.f};
  int64_t d = 0;
  for (; d + LANES <= D; d += LANES)
    for (int j = 0; j < LANES; ++j) acc[j] += q[d + j] * k[d + j];
  float s = 0.f;
  for (int j = 0; j < LANES; ++j) s += acc[j];
  for (; d < D; ++d) s += q[d] * k[d];
  return s;
}

// p[l] = exp(p[l] - m) over n scores (m their max); returns their sum
inline float exp_shifted(float* p, int64_t n, float m) {
#if defined(__AVX512F__)
  __m512 acc = _mm512_setzero_ps();
  const __m512 mv = _mm512_set1_ps(m);
  for (int64_t l = 0; l < n; l += 16) {
    const __mmask16 k = n - l >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (n - l)) - 1u);
    const __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, p + l), mv));
    _mm512_mask_storeu_ps(p + l, k, e);
    acc = _mm512_add_ps(acc, _mm512_maskz_mov_ps(k, e));
  }
  return _mm512_reduce_add_ps(acc);
#elif defined(__AVX2__) && defined(__FMA__)
  __m256 acc = _mm256_setzero_ps();
  const __m256 mv = _mm256_set1_ps(m);
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  for (int64_t l = 0; l < n; l += 8) {
    const __m256i k = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n - l < 8 ? n - l : 8)), lane);
    const __m256 e = _mm256_and_ps(exp8(_mm256_sub_ps(_mm256_maskload_ps(p + l, k), mv)),
                                   _mm256_castsi256_ps(k));
    _mm256_maskstore_ps(p + l, k, e);
    acc = _mm256_add_ps(acc, e);
  }
  return hsum8(acc);
#else
  float sum = 0.f;
  for (int64_t l = 0; l < n; ++l) {
    p[l] = std::exp(p[l] - m);
    sum += p[l];
  }
  return sum;
#endif
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
// attend_one for bfloat16 caches, D a multiple of 32 up to 256, G query heads per kv head
// (a template argument: the V sums stay in registers): the scores of 16 positions at a
// time by vdpbf16ps (products of bfloat16 q and k exact, float32 sums) and one reduce16,
// the float32 softmax as below, the V rows' weighted sum 16 dims at a time, all G heads at
// once. ~3x the generic loops on SmolLM2's heads (their horizontal sums and scalar
// conversions were most of a decode step's attention).
template <int G>
void attend_bf16(const uint16_t* q, const uint16_t* kc, const uint16_t* vc, int64_t ctx,
                 int64_t Hkv, int64_t D, float scale, const int64_t* offs, uint16_t* out) {
  thread_local std::vector<float> p;
  p.resize(G * ctx);
  const __m512 sv = _mm512_set1_ps(scale);
  for (int64_t h = 0; h < Hkv; ++h) {
    const uint16_t* qh = q + h * G * D;
    for (int64_t l0 = 0; l0 < ctx; l0 += 16) {
      const int n = static_cast<int>(ctx - l0 < 16 ? ctx - l0 : 16);
      const __mmask16 mask = static_cast<__mmask16>(n == 16 ? 0xFFFF : (1u << n) - 1u);
      for (int g = 0; g < G; ++g) {
        __m512 a[16];
        for (int j = 0; j < 16; ++j) {
          a[j] = _mm512_setzero_ps();
          if (j >= n) continue;
          const uint16_t* kr = kc + offs[l0 + j] + h * D;
          for (int64_t c = 0; c < D; c += 32)
            a[j] = _mm512_dpbf16_ps(a[j], (__m512bh)_mm512_loadu_si512(kr + c),
                                    (__m512bh)_mm512_loadu_si512(qh + g * D + c));
        }
        _mm512_mask_storeu_ps(&p[g * ctx + l0], mask, _mm512_mul_ps(reduce16(a), sv));
      }
    }
    float inv[G];
    for (int g = 0; g < G; ++g) {
      float* pg = &p[g * ctx];
      float m = pg[0];
      for (int64_t l = 1; l < ctx; ++l) m = pg[l] > m ? pg[l] : m;
      inv[g] = 1.f / exp_shifted(pg, ctx, m);
    }
    for (int64_t c = 0; c < D; c += 16) {
      __m512 acc[G];
      for (int g = 0; g < G; ++g) acc[g] = _mm512_setzero_ps();
      for (int64_t l = 0; l < ctx; ++l) {
        const __m512 v = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(vc + offs[l] + h * D + c))), 16));
        for (int g = 0; g < G; ++g) acc[g] = _mm512_fmadd_ps(_mm512_set1_ps(p[g * ctx + l]), v, acc[g]);
      }
      for (int g = 0; g < G; ++g)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + (h * G + g) * D + c),
                            (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(acc[g], _mm512_set1_ps(inv[g]))));
    }
  }
}

// the fast path's kernel and where it applies: bfloat16, D % 32 == 0, D <= 256, G <= 8
template <typename T> constexpr bool kFastType = std::is_same_v<T, c10::BFloat16>;
constexpr int64_t kFastAlign = 32;
template <int G, typename T>
void attend_kernel(const T* q, const T* kc, const T* vc, int64_t ctx, int64_t Hkv, int64_t D,
                   float scale, const int64_t* offs, T* out) {
  attend_bf16<G>(reinterpret_cast<const uint16_t*>(q), reinterpret_cast<const uint16_t*>(kc),
                 reinterpret_cast<const uint16_t*>(vc), ctx, Hkv, D, scale, offs,
                 reinterpret_cast<uint16_t*>(out));
}
#elif defined(__AVX2__) && defined(__FMA__)
// attend_one in 8 float32 lanes for float32 and bfloat16 caches (CPUs without AVX-512:
// AVX2 + FMA), D a multiple of 8 up to 256, G <= 8 query heads per kv head: the scores of
// 8 positions at a time (8 K rows against one head's q, one reduce8), the softmax's exps
// by exp8, the V rows' weighted sum CB x 8 dims at a time for all G heads (CB = 2 while
// 2G accumulators fit the 16 registers). The generic loops below, with std::exp one score
// at a time, were ~3x slower on SmolLM2's heads.
template <int G, int CB, typename T>
void attend8(const T* q, const T* kc, const T* vc, int64_t ctx, int64_t Hkv, int64_t D,
             float scale, const int64_t* offs, T* out) {
  thread_local std::vector<float> p;
  p.resize(G * ctx);
  alignas(32) float qf[G * 256];
  alignas(32) float s8[8 * CB];
  const __m256 sv = _mm256_set1_ps(scale);
  for (int64_t h = 0; h < Hkv; ++h) {
    for (int64_t i = 0; i < G * D; ++i) qf[i] = to_f(q[h * G * D + i]);
    for (int64_t l0 = 0; l0 < ctx; l0 += 8) {
      const int n = static_cast<int>(ctx - l0 < 8 ? ctx - l0 : 8);
      const T* kr[8];
      for (int j = 0; j < 8; ++j) kr[j] = kc + offs[l0 + (j < n ? j : 0)] + h * D;   // tail: a row again, dropped
      for (int g = 0; g < G; ++g) {
        __m256 a[8];
        for (int j = 0; j < 8; ++j) a[j] = _mm256_setzero_ps();
        for (int64_t c = 0; c < D; c += 8) {
          const __m256 qv = _mm256_load_ps(qf + g * D + c);
          for (int j = 0; j < 8; ++j) a[j] = _mm256_fmadd_ps(ld8(kr[j] + c), qv, a[j]);
        }
        _mm256_store_ps(s8, _mm256_mul_ps(reduce8(a), sv));
        std::memcpy(&p[g * ctx + l0], s8, sizeof(float) * n);
      }
    }
    float inv[G];
    for (int g = 0; g < G; ++g) {
      float* pg = &p[g * ctx];
      float m = pg[0];
      for (int64_t l = 1; l < ctx; ++l) m = pg[l] > m ? pg[l] : m;
      inv[g] = 1.f / exp_shifted(pg, ctx, m);
    }
    for (int64_t c = 0; c < D; c += 8 * CB) {
      __m256 acc[G][CB];
      for (int g = 0; g < G; ++g)
        for (int b = 0; b < CB; ++b) acc[g][b] = _mm256_setzero_ps();
      for (int64_t l = 0; l < ctx; ++l) {
        const T* vr = vc + offs[l] + h * D + c;
        __m256 v[CB];
        for (int b = 0; b < CB; ++b) v[b] = ld8(vr + 8 * b);
        for (int g = 0; g < G; ++g) {
          const __m256 w = _mm256_set1_ps(p[g * ctx + l]);
          for (int b = 0; b < CB; ++b) acc[g][b] = _mm256_fmadd_ps(w, v[b], acc[g][b]);
        }
      }
      for (int g = 0; g < G; ++g) {
        for (int b = 0; b < CB; ++b)
          _mm256_store_ps(s8 + 8 * b, _mm256_mul_ps(acc[g][b], _mm256_set1_ps(inv[g])));
        for (int k = 0; k < 8 * CB; ++k) out[(h * G + g) * D + c + k] = from_f<T>(s8[k]);
      }
    }
  }
}

// the fast path's kernel and where it applies: float32 or bfloat16, D % 8 == 0, D <= 256,
// G <= 8
template <typename T>
constexpr bool kFastType = std::is_same_v<T, c10::BFloat16> || std::is_same_v<T, float>;
constexpr int64_t kFastAlign = 8;
template <int G, typename T>
void attend_kernel(const T* q, const T* kc, const T* vc, int64_t ctx, int64_t Hkv, int64_t D,
                   float scale, const int64_t* offs, T* out) {
  if constexpr (G <= 6) {
    if (D % 16 == 0) return attend8<G, 2>(q, kc, vc, ctx, Hkv, D, scale, offs, out);
  }
  attend8<G, 1>(q, kc, vc, ctx, Hkv, D, scale, offs, out);
}
#endif

#if (defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)) || \
    (defined(__AVX2__) && defined(__FMA__))
// f(Int<G>{}) for G in 1..8: the query heads per kv head as a template argument
template <typename F>
void with_g(int64_t G, F f) {
  switch (G) {
    case 1: f(Int<1>{}); break;
    case 2: f(Int<2>{}); break;
    case 3: f(Int<3>{}); break;
    case 4: f(Int<4>{}); break;
    case 5: f(Int<5>{}); break;
    case 6: f(Int<6>{}); break;
    case 7: f(Int<7>{}); break;
    default: f(Int<8>{}); break;
  }
}

// the fast path where it applies (kFastType, D % kFastAlign == 0, D <= 256, G <= 8): true
// if taken
template <typename T, typename Rows>
bool attend_fast(const T* q, const T* kc, const T* vc, int64_t ctx, int64_t Hq, int64_t Hkv,
                 int64_t D, float scale, Rows rows, T* out) {
  if constexpr (!kFastType<T>) {
    return false;
  } else {
    const int64_t G = Hq / Hkv;
    if (D % kFastAlign || D > 256 || G > 8) return false;
    thread_local std::vector<int64_t> offs;
    offs.resize(ctx);
    for (int64_t l = 0; l < ctx; ++l) offs[l] = rows(l);
    with_g(G, [&](auto g) {
      attend_kernel<decltype(g)::value>(q, kc, vc, ctx, Hkv, D, scale, offs.data(), out);
    });
    return true;
  }
}
#else
template <typename T, typename Rows>
bool attend_fast(const T*, const T*, const T*, int64_t, int64_t, int64_t, int64_t, float, Rows, T*) {
  return false;
}
#endif

// rows(l) -> the cache row (element offset of [.., h=0, 0]) of context position l
template <typename T, typename Rows>
void attend_one(const T* q, const T* kc, const T* vc, int64_t ctx, int64_t Hq, int64_t Hkv,
                int64_t D, float scale, Rows rows, T* out) {
  const int64_t G = Hq / Hkv;
  if (ctx == 0) {
    for (int64_t i = 0; i < Hq * D; ++i) out[i] = from_f<T>(0.f);
    return;
  }
  if (attend_fast(q, kc, vc, ctx, Hq, Hkv, D, scale, rows, out)) return;
  std::vector<float> qf(G * D), kf(D), p(G * ctx), acc(G * D), inv(G);
  for (int64_t h = 0; h < Hkv; ++h) {
    for (int64_t i = 0; i < G * D; ++i) qf[i] = to_f(q[h * G * D + i]);
    for (int64_t l = 0; l < ctx; ++l) {
      const T* kr = kc + rows(l) + h * D;
      for (int64_t d = 0; d < D; ++d) kf[d] = to_f(kr[d]);
      for (int64_t g = 0; g < G; ++g) p[g * ctx + l] = dot(&qf[g * D], kf.data(), D) * scale;
    }
    std::fill(acc.begin(), acc.end(), 0.f);
    for (int64_t g = 0; g < G; ++g) {
      float* pg = &p[g * ctx];
      float m = pg[0];
      for (int64_t l = 1; l < ctx; ++l) m = pg[l] > m ? pg[l] : m;
      inv[g] = 1.f / exp_shifted(pg, ctx, m);
    }
    for (int64_t l = 0; l < ctx; ++l) {
      const T* vr = vc + rows(l) + h * D;
      for (int64_t d = 0; d < D; ++d) kf[d] = to_f(vr[d]);
      for (int64_t g = 0; g < G; ++g) {
        const float w = p[g * ctx + l];
        float* __restrict a = &acc[g * D];
        const float* __restrict vv = kf.data();
        for (int64_t d = 0; d < D; ++d) a[d] += w * vv[d];
      }
    }
    for (int64_t g = 0; g < G; ++g)
      for (int64_t d = 0; d < D; ++d)
        out[(h * G + g) * D + d] = from_f<T>(acc[g * D + d] * inv[g]);
  }
}

}  // namespace

// q [B, Hq, D]; caches [NB, BS, Hkv, D] contiguous; block_tables [B, max_blocks] int32;
// context_lens [B] int32 -> [B, Hq, D] in q's dtype
at::Tensor paged_decode(const at::Tensor& q, const at::Tensor& k_cache,
                        const at::Tensor& v_cache, const at::Tensor& block_tables,
                           const at::Tensor& context_lens, double scale) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && k_cache.is_contiguous() &&
                  v_cache.is_contiguous() && k_cache.sizes() == v_cache.sizes() &&
                  k_cache.scalar_type() == q.scalar_type() &&
                  v_cache.scalar_type() == q.scalar_type(),
              "paged_decode: q [B, Hq, D] and contiguous caches [NB, BS, Hkv, D] of q's dtype");
  const int64_t B = q.size(0), Hq = q.size(1), D = q.size(2);
  const int64_t NB = k_cache.size(0), BS = k_cache.size(1), Hkv = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == D && Hkv > 0 && Hq % Hkv == 0, "paged_decode: head shapes");
  auto bt = block_tables.to(at::kInt).contiguous();
  auto cl = context_lens.to(at::kInt).contiguous();
  TORCH_CHECK(bt.dim() == 2 && bt.size(0) == B && cl.numel() == B,
              "paged_decode: block_tables [B, max_blocks], context_lens [B]");
  const int64_t MB = bt.size(1);
  const int32_t* t = bt.data_ptr<int32_t>();
  const int32_t* lens = cl.data_ptr<int32_t>();
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(lens[b] >= 0 && (lens[b] + BS - 1) / BS <= MB, "paged_decode: context too long");
    for (int64_t j = 0; j < (lens[b] + BS - 1) / BS; ++j)
      TORCH_CHECK(t[b * MB + j] >= 0 && t[b * MB + j] < NB, "paged_decode: block out of range");
  }
  auto qc = q.contiguous();
  auto out = at::empty({B, Hq, D}, qc.options());
  const int64_t row = Hkv * D;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, qc.scalar_type(), "paged_decode", [&] {
    const scalar_t* kc = k_cache.data_ptr<scalar_t>();
    const scalar_t* vc = v_cache.data_ptr<scalar_t>();
    at::parallel_for(0, B, 1, [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b) {
        const int32_t* tb = t + b * MB;
        auto rows = [&](int64_t l) { return (tb[l / BS] * BS + l % BS) * row; };
        attend_one(qc.data_ptr<scalar_t>() + b * Hq * D, kc, vc, lens[b], Hq, Hkv, D,
                   static_cast<float>(scale), rows, out.data_ptr<scalar_t>() + b * Hq * D);
      }
    });
  });
  return out;
}

// n query rows q [n, Hq, D] of one sequence, the last n of its ctx = slots.numel()
// positions: row i attends slots[0, ctx - n + i] exactly as slots_decode attends one
// decode row (deterministic mode: a position's output does not depend on how many rows
// were computed with it, so a prefill's KV is bit for bit the decode steps' KV)
at::Tensor slots_causal(const at::Tensor& q, const at::Tensor& kf,
                        const at::Tensor& vf, const at::Tensor& slots, double scale) {
  TORCH_CHECK(q.dim() == 3 && kf.dim() == 3 && kf.is_contiguous() && vf.is_contiguous() &&
                  kf.sizes() == vf.sizes() && kf.scalar_type() == q.scalar_type() &&
                  vf.scalar_type() == q.scalar_type(),
              "slots_causal: q [n, Hq, D] and contiguous caches [NS, Hkv, D] of q's dtype");
  const int64_t n = q.size(0), Hq = q.size(1), D = q.size(2), NS = kf.size(0),
                Hkv = kf.size(1);
  TORCH_CHECK(kf.size(2) == D && Hkv > 0 && Hq % Hkv == 0, "slots_causal: head shapes");
  auto sc = slots.to(at::kLong).contiguous();
  const int64_t* s = sc.data_ptr<int64_t>();
  const int64_t ctx = sc.numel();
  TORCH_CHECK(n <= ctx, "slots_causal: more rows than context");
  for (int64_t i = 0; i < ctx; ++i)
    TORCH_CHECK(s[i] >= 0 && s[i] < NS, "slots_causal: slot out of range");
  auto qc = q.contiguous();
  auto out = at::empty({n, Hq, D}, qc.options());
  const int64_t row = Hkv * D;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, qc.scalar_type(), "slots_causal", [&] {
    auto rows = [&](int64_t l) { return s[l] * row; };
    at::parallel_for(0, n, 1, [&](int64_t i0, int64_t i1) {   // rows are independent
      for (int64_t i = i0; i < i1; ++i)
        attend_one(qc.data_ptr<scalar_t>() + i * Hq * D, kf.data_ptr<scalar_t>(),
                   vf.data_ptr<scalar_t>(), ctx - n + i + 1, Hq, Hkv, D,
                   static_cast<float>(scale), rows, out.data_ptr<scalar_t>() + i * Hq * D);
    });
  });
  return out;
}

// one query row q [Hq, D] over flat slots [ctx] int64 of caches viewed [NS, Hkv, D]: the
// last (only) row of slots_causal
at::Tensor slots_decode(const at::Tensor& q, const at::Tensor& kf,
                        const at::Tensor& vf, const at::Tensor& slots, double scale) {
  TORCH_CHECK(q.dim() == 2, "slots_decode: q [Hq, D]");
  return slots_causal(q.unsqueeze(0), kf, vf, slots, scale).squeeze(0);
}
