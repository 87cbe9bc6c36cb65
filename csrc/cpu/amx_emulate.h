// amx_emulate.h -- the four AMX tile instructions that quant.cpp's qamx uses, in scalar C++, so that its tile logic
// (the B tile it dequantizes, the A tiles it reads from x, what it stores) is tested on CPUs without AMX.
// Included only when quant.cpp is compiled with -DMINISGL_AMX_EMULATE (tests/test_amx_emulated.py); never in the
// extension. Eight tiles of 16 rows x 64 bytes, as amx_tiles_16x64() configures them.
#pragma once
#include <cstdint>
#include <cstring>

namespace minisgl {
namespace emulate {

alignas(64) inline thread_local unsigned char tiles[8][16][64];   // each thread its own tiles, as on AMX

inline float bf16(uint16_t v) {
  const uint32_t u = uint32_t(v) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline void load(int t, const void* p, int64_t stride) {
  for (int r = 0; r < 16; ++r) std::memcpy(tiles[t][r], static_cast<const char*>(p) + r * stride, 64);
}
inline void store(int t, void* p, int64_t stride) {
  for (int r = 0; r < 16; ++r) std::memcpy(static_cast<char*>(p) + r * stride, tiles[t][r], 64);
}
inline void zero(int t) { std::memset(tiles[t], 0, sizeof(tiles[t])); }
// tdpbf16ps: C[m][n] += sum over pairs p of A[m][2p] * B[p][2n] + A[m][2p + 1] * B[p][2n + 1] (fp32 C, bf16 A and B)
inline void dpbf16ps(int c, int a, int b) {
  for (int m = 0; m < 16; ++m)
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
