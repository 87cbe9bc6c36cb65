// amx_emulate.h -- the four AMX tile instructions that the AMX bodies use (quant.cpp's qamx, attention_amx.h's decode
// and extend), in scalar C++, so that their tile logic (the tiles they build, the rows they load, what they store)
// is tested on CPUs without AMX. Included (by amx.h) only when the extension is compiled with -DMINISGL_AMX_EMULATE
// (tests/test_amx_emulated.py); never in the one that is installed. Eight tiles of 64 bytes a row and the rows that amx.h's
// configurations give them (`configure`): a load fills the configured rows and zeroes the others, a store writes
// the configured rows only, as the hardware does.
#pragma once
#include <immintrin.h>   // first: the tile intrinsics' names below replace its own
#include <cstdint>
#include <cstring>

namespace minisgl {
namespace emulate {

alignas(64) inline thread_local unsigned char tiles[8][16][64];   // each thread its own tiles, as on AMX
inline thread_local int tile_rows[8] = {16, 16, 16, 16, 16, 16, 16, 16};

// amx_tiles_rows(r0, r1) as gemm_amx.cpp configures it: tmm0, tmm1 and tmm4 r0 rows, tmm2, tmm3 and tmm5 r1 rows
// (0 counts as 1), tmm6 and tmm7 16; amx_tiles_16x64() is configure(16, 16).
inline void configure(int r0, int r1) {
  const int rows[8] = {r0, r0, r1, r1, r0, r1, 16, 16};
  for (int t = 0; t < 8; ++t) tile_rows[t] = rows[t] < 1 ? 1 : rows[t];
}

inline float bf16(uint16_t v) {
  const uint32_t u = uint32_t(v) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline void load(int t, const void* p, int64_t stride) {
  for (int r = 0; r < 16; ++r) {
    if (r < tile_rows[t]) std::memcpy(tiles[t][r], static_cast<const char*>(p) + r * stride, 64);
    else std::memset(tiles[t][r], 0, 64);
  }
}
inline void store(int t, void* p, int64_t stride) {
  for (int r = 0; r < tile_rows[t]; ++r) std::memcpy(static_cast<char*>(p) + r * stride, tiles[t][r], 64);
}
inline void zero(int t) { std::memset(tiles[t], 0, sizeof(tiles[t])); }
// tdpbf16ps: C[m][n] += sum over pairs p of A[m][2p] * B[p][2n] + A[m][2p + 1] * B[p][2n + 1] (fp32 C, bf16 A and B)
inline void dpbf16ps(int c, int a, int b) {
  for (int m = 0; m < tile_rows[c]; ++m)
    for (int n = 0; n < 16; ++n) {
      float acc;
      std::memcpy(&acc, tiles[c][m] + 4 * n, 4);
      for (int p = 0; p < 16; ++p)
        for (int e = 0; e < 2; ++e) {
          uint16_t x, w;
          std::memcpy(&x, tiles[a][m] + 2 * (2 * p + e), 2);
          std::memcpy(&w, tiles[b][p] + 2 * (2 * n + e), 2);
          acc += bf16(x) * bf16(w);
        }
      std::memcpy(tiles[c][m] + 4 * n, &acc, 4);
    }
}

}  // namespace emulate
}  // namespace minisgl

#define _tile_loadd(t, p, stride) ::minisgl::emulate::load(t, p, stride)
#define _tile_stored(t, p, stride) ::minisgl::emulate::store(t, p, stride)
#define _tile_zero(t) ::minisgl::emulate::zero(t)
#define _tile_dpbf16ps(c, a, b) ::minisgl::emulate::dpbf16ps(c, a, b)
