// A few-row matmul's walk over its output [M, N] in register tiles of NR weight rows by MR
// rows of x: 4 x 1 for one row of x, 2 x 2 for two, 1 x MR for three or four (and 1 x MR
// for the last weight rows that do not fill a tile). tile(NR, MR, n, m0, out) computes
// weight rows n.. and x rows m0.. into out[r * MR + m] (NR and MR as integral constants);
// the walk scatters out into y (rows ldy apart). int4_gemv.cpp and int8_gemv.cpp share it.
#pragma once
#include <cstdint>
#include <type_traits>

template <int V> using Int = std::integral_constant<int, V>;

template <typename Tile>
void walk_tiles(int64_t M, int64_t N, float* y, Tile tile, int64_t ldy = -1) {
  if (ldy < 0) ldy = N;   // y's row stride (a span of the weight rows writes into a wider y)
  float o[4];
  for (int64_t m0 = 0; m0 < M; m0 += 4) {
    const int mr = static_cast<int>(M - m0 < 4 ? M - m0 : 4);
    const int nr = mr == 1 ? 4 : (mr == 2 ? 2 : 1);
    for (int64_t n = 0; n < N;) {
      const int step = N - n >= nr ? nr : 1;
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
