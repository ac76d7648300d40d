// x @ w.T for the int4 and int8 weights at a decode batch's rows (9 to 64 for int4, 3 on
// for int8): each weight row is decoded to bfloat16 once per call, into an L1 buffer, and
// multiplied there against every row of x. int4_gemv.cpp's tiles apply each group's scale
// after its dot (two float ops per row and group, the weight decoded again for every four
// rows of x); here the decoded weight carries its scale, so a row and a 32-input block cost
// one vdpbf16ps. Before this, 16 rows took the dequantized weight through memory and
// oneDNN's bfloat16 GEMM (int4), or torch's int8 kernel, which reads the weight once per
// four rows (the LM head: 27 of a 16-row step's 91 ms on one core).
//
// The int4 weight (int4_gemv.cpp's layout) is decoded to exactly int4_dequant's bfloat16
// values: each group's 16 possible values, (q - 8) * scale + zero in float32 then rounded,
// make a table that vpermw indexes by the codes. The int8 weight: q exactly in bfloat16,
// the row's scale applied to the dot. x is rounded to bfloat16 (as the int4 and int8
// kernels of torch take it).
//
// Row invariance: every (row of x, weight row) pair runs the same instructions in the same
// order whatever M is and wherever the row sits (a tile of 4 x 4 with zero rows past the
// end, one accumulator per pair over the blocks in order, one fixed reduction tree): a
// sequence's logits do not depend on its batch within this kernel's range of rows.
#include "aten.h"
#include <immintrin.h>
#include <cstdint>
#include <algorithm>
#include <cstring>
#include <vector>

#include "bf16.h"
#include "helper.h"
#include "simd.h"

namespace {

constexpr int64_t kBlock = 32;   // inputs per block (an int4 group)
constexpr int kNR = 4, kMR = 4;  // weight rows x rows of x per tile
constexpr int64_t kMChunk = 64;  // rows of x per pass over the weight (x stays in L1/L2)

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
constexpr bool kBatchSimd = true;

// x [M, K] -> bfloat16 rows (the rows past M, to a multiple of kMR, stay zero)
template <typename T>
void prep_x(const T* x, int64_t M, int64_t K, uint16_t* out) {
  for (int64_t i = 0; i < M * K; ++i) {
    if constexpr (std::is_same_v<T, c10::BFloat16>) out[i] = x[i].x;
    else out[i] = bf16_bits(static_cast<float>(x[i]));
  }
}

// int4 weight row (gemv_pack's layout) -> K bfloat16: each group's 16 values
// bfloat16((q - 8) * scale + zero) (a product, then a sum, in float32: int4_dequant's bits)
// as a table, and vpermw picks each input's from its code
void decode_int4(const uint8_t* wq, const uint16_t* sc, const uint16_t* ze, int64_t K,
                 uint16_t* out) {
  const __m512i lo4 = _mm512_set1_epi16(0x000F);
  const __m512 q8 = _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7);
  const int64_t ng = K / kBlock;
  alignas(64) float s[16], z[16];
  for (int64_t g = 0; g < ng; g += 2) {
    if (g % 16 == 0) {
      const __mmask16 mask = static_cast<__mmask16>(ng - g >= 16 ? 0xFFFF : (1u << (ng - g)) - 1u);
      _mm512_store_ps(s, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, sc + g)), 16)));
      _mm512_store_ps(z, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, ze + g)), 16)));
    }
    const __m512i b = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wq + g * 16)));
    const __m512i codes[2] = {_mm512_and_si512(b, lo4), _mm512_srli_epi16(b, 4)};
    for (int h = 0; h < 2; ++h) {
      const int i = static_cast<int>((g + h) % 16);
      const __m512 v = _mm512_add_ps(_mm512_mul_ps(q8, _mm512_set1_ps(s[i])), _mm512_set1_ps(z[i]));
      const __m512i table = _mm512_castsi256_si512((__m256i)_mm512_cvtneps_pbh(v));
      _mm512_storeu_si512(out + (g + h) * kBlock, _mm512_permutexvar_epi16(codes[h], table));
    }
  }
}

// int8 weight row -> K bfloat16 (exact), in input order
void decode_int8(const int8_t* q, int64_t K, uint16_t* out) {
  for (int64_t b = 0; b < K; b += 16) {
    const __m512 v = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + b))));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + b), (__m256i)_mm512_cvtneps_pbh(v));
  }
}

// kNR decoded weight rows (wb, K apart) against kMR rows of x -> o[m * kNR + r]
void tile(const uint16_t* wb, const uint16_t* xb, int64_t K, float* o) {
  __m512 acc[kMR * kNR];
  for (auto& a : acc) a = _mm512_setzero_ps();
  for (int64_t b = 0; b < K; b += kBlock) {
    __m512bh w[kNR];
    for (int r = 0; r < kNR; ++r) w[r] = (__m512bh)_mm512_loadu_si512(wb + r * K + b);
    for (int m = 0; m < kMR; ++m) {
      const __m512bh xv = (__m512bh)_mm512_loadu_si512(xb + m * K + b);
      for (int r = 0; r < kNR; ++r) acc[m * kNR + r] = _mm512_dpbf16_ps(acc[m * kNR + r], w[r], xv);
    }
  }
  _mm512_storeu_ps(o, reduce16(acc));   // lane j = m * kNR + r: acc's order
}

// y[m, n] = scale(n) * dot(x[m], w[n]) for all rows; decode(n, out) writes weight row n.
// Work items: (pass over kMChunk rows of x, kSpan weight rows), on the helper too when on;
// an item's outputs fill whole cache lines of y (items of one tile each had the two threads
// writing the same lines: slower on two cores than on one).
template <typename Decode, typename Scale>
void gemm(const uint16_t* xb, int64_t M, int64_t Mp, int64_t K, int64_t N, float* y,
          Decode decode, Scale scale) {
  constexpr int64_t kSpan = 64;
  const int64_t spans = (N + kSpan - 1) / kSpan, passes = (Mp + kMChunk - 1) / kMChunk;
  const std::function<void(int64_t)> item = [&](int64_t i) {
    thread_local std::vector<uint16_t> wb;
    wb.resize(kNR * K);
    alignas(64) float o[kMR * kNR];
    const int64_t mc = i / spans * kMChunk, n1 = std::min(N, (i % spans + 1) * kSpan);
    const int64_t mend = std::min(Mp, mc + kMChunk);
    for (int64_t n0 = i % spans * kSpan; n0 < n1; n0 += kNR) {
      const int64_t nr = std::min<int64_t>(n1 - n0, kNR);
      for (int r = 0; r < kNR; ++r) {
        if (r < nr) decode(n0 + r, wb.data() + r * K);
        else std::memset(wb.data() + r * K, 0, K * 2);
      }
      for (int64_t m0 = mc; m0 < mend; m0 += kMR) {
        tile(wb.data(), xb + m0 * K, K, o);
        for (int m = 0; m < kMR && m0 + m < M; ++m)
          for (int r = 0; r < nr; ++r) y[(m0 + m) * N + n0 + r] = o[m * kNR + r] * scale(n0 + r);
      }
    }
  };
  share(spans * passes, item);
}
#else
constexpr bool kBatchSimd = false;
#endif

// x -> its rows as bfloat16, padded with zero rows to a multiple of kMR, for body (gemm);
// the output as float32, returned in x's dtype
template <typename Body>
at::Tensor run(const at::Tensor& x, int64_t N, const char* name, Body body) {
  TORCH_CHECK(kBatchSimd, name, ": built without AVX512-BF16 (batch_simd() is false)");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && !x.is_cuda(), name, ": x [M, K] contiguous CPU");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              name, ": x float32 or bfloat16");
  const int64_t M = x.size(0), K = x.size(1), Mp = (M + kMR - 1) / kMR * kMR;
  TORCH_CHECK(K % kBlock == 0, name, ": in_features a multiple of 32");
  auto yf = at::empty({M, N}, x.options().dtype(at::kFloat));
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
  std::vector<uint16_t> xb(Mp * K, 0);
  {
    pybind11::gil_scoped_release_simple nogil;  // the engine thread's matmul; the event loop runs on
    if (x.scalar_type() == at::kBFloat16) prep_x(x.data_ptr<at::BFloat16>(), M, K, xb.data());
    else prep_x(x.data_ptr<float>(), M, K, xb.data());
    body(xb.data(), M, Mp, K, yf.data_ptr<float>());
  }
#endif
  return x.scalar_type() == at::kFloat ? yf : yf.to(x.scalar_type());
}

}  // namespace

bool batch_simd() { return kBatchSimd; }

// whether int4_gemv, int4_gemm and int8_gemm share their work with the helper thread
void set_batch_helper(bool on) { helper_flag().store(on); }
bool batch_helper_on() { return helper_on(); }

// x [M, K] float32 | bfloat16, codes [N, K/2] (gemv_pack), scale and zero bfloat16
// [N, K/32] -> [M, N] in x's dtype
at::Tensor int4_gemm(const at::Tensor& x, const at::Tensor& codes,
                     const at::Tensor& scale, const at::Tensor& zero) {
  const int64_t N = codes.size(0), K = codes.size(1) * 2;
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.is_contiguous() && x.size(-1) == K &&
                  K % 64 == 0, "int4_gemm: codes [N, K/2] uint8, K a multiple of 64");
  for (const auto* t : {&scale, &zero})
    TORCH_CHECK(t->scalar_type() == at::kBFloat16 && t->is_contiguous() && t->size(0) == N &&
                    t->size(1) == K / kBlock, "int4_gemm: scale, zero [N, K/32] bfloat16");
  const auto* wq = codes.data_ptr<uint8_t>();
  const auto* sc = reinterpret_cast<const uint16_t*>(scale.data_ptr<at::BFloat16>());
  const auto* ze = reinterpret_cast<const uint16_t*>(zero.data_ptr<at::BFloat16>());
  return run(x, N, "int4_gemm", [&](const uint16_t* xb, int64_t M, int64_t Mp, int64_t K_, float* y) {
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
    const int64_t ng = K_ / kBlock;
    gemm(xb, M, Mp, K_, N, y,
         [&](int64_t n, uint16_t* out) { decode_int4(wq + n * ng * 16, sc + n * ng, ze + n * ng, K_, out); },
         [](int64_t) { return 1.f; });
#endif
  });
}

// x [M, K] float32 | bfloat16, q [N, K] int8, scale [N] -> [M, N] in x's dtype
at::Tensor int8_gemm(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale) {
  const int64_t N = q.size(0);
  TORCH_CHECK(q.scalar_type() == at::kChar && q.is_contiguous() && q.size(1) == x.size(-1),
              "int8_gemm: q [N, K] int8 contiguous");
  TORCH_CHECK(scale.numel() == N, "int8_gemm: scale [N]");
  const auto sf = scale.to(at::kFloat).contiguous();
  const float* s = sf.data_ptr<float>();
  const int8_t* qp = q.data_ptr<int8_t>();
  return run(x, N, "int8_gemm", [&](const uint16_t* xb, int64_t M, int64_t Mp, int64_t K, float* y) {
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
    gemm(xb, M, Mp, K, N, y, [&](int64_t n, uint16_t* out) { decode_int8(qp + n * K, K, out); },
         [s](int64_t n) { return s[n]; });
#endif
  });
}
