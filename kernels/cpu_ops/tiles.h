// A few-row matmul's walk over its output [M, N] in register tiles of NR weight rows by MR
// rows of x: 4 x 1 for one row of x, 2 x 2 for two, 1 x MR for three or four (and 1 x MR
// for the last weight rows that do not fill a tile). tile(NR, MR, n, m0, out) computes
// weight rows n.. and x rows m0.. into out[r * MR + m] (NR and MR as integral constants);
// the walk scatters out into y (rows ldy apart). It goes 64 weight rows at a time, each
// block against every row of x while it is in cache. int4_gemv.cpp and int8_gemv.cpp share it.
#pragma once
#include <cstdint>
#include <type_traits>

template <int V> using Int = std::integral_constant<int, V>;

template <typename Tile>
void walk_tiles(int64_t M, int64_t N, float* y, Tile tile, int64_t ldy = -1) {
  if (ldy < 0) ldy = N;   // y's row stride (a span of the weight rows writes into a wider y)
  constexpr int64_t kBlock = 64;   // weight rows read from memory once, then from cache by
  float o[4];                      // each group of 4 rows of x
  for (int64_t n0 = 0; n0 < N; n0 += kBlock) {
    const int64_t n1 = N - n0 < kBlock ? N : n0 + kBlock;
    for (int64_t m0 = 0; m0 < M; m0 += 4) {
      const int mr = static_cast<int>(M - m0 < 4 ? M - m0 : 4);
      const int nr = mr == 1 ? 4 : (mr == 2 ? 2 : 1);
      for (int64_t n = n0; n < n1;) {
        const int step = n1 - n >= nr ? nr : 1;
        if (step == 4) tile(Int<4>{}, Int<1>{}, n, m0, o);
        else if (step == 2) tile(Int<2>{}, Int<2>{}, n, m0, o);
        else if (mr == 1) tile(Int<1>{}, Int<1>{}, n, m0, o);
        else if (mr == 2) tile(Int<1>{}, Int<2>{}, n, m0, o);
        else if (mr == 3) tile(Int<1>{}, Int<3>{}, n, m0, o);
        else tile(Int<1>{}, Int<4>{}, n, m0, o);
        for (int r = 0; r < step; ++r)
          for (int i = 0; i < mr; ++i) y[(m0 + i) * ldy + n + r] = o[r * mr + i];
        n += step;
      }
    }
  }
}
