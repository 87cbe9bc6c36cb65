// gemm_amx.cpp -- the packed tiles' product on AMX (Intel's Advanced Matrix Extensions): y[M, N] = x[M, K] @ W^T
// over the same packed weight as gemm_bf16.cpp, so a linear that runs both keeps one copy of W.
//
// AMX adds eight tile registers of 16 rows x 64 bytes and one instruction, `tdpbf16ps`, that multiplies a tile of
// 16 rows x 32 bf16 of x (A) with a tile of 16 pairs of k x 16 outputs of W (B) into 16 x 16 fp32 sums (C): 16K
// multiply-adds per instruction, against 256 for AVX512-BF16's `vdpbf16ps`.
//   - The packed layout [N/16][K/2][16][2] is already B's layout: 16 consecutive k-pairs of one block of 16
//     outputs are 1 KB of contiguous memory, one tile load with a stride of 64 bytes. A is loaded straight from
//     x's rows (stride: x's row stride), so nothing is repacked per call.
//   - A register block is 2 x 2 tiles of C (32 rows x 32 outputs): tmm0..3 hold the sums, tmm4..5 two tiles of
//     x, tmm6..7 two tiles of W; each k step of 32 loads four tiles for four products. A block of fewer rows
//     configures its tiles with fewer rows (a tile configuration, `ldtilecfg`, per shape of block), so x is
//     never read past its last row. K must be a multiple of 32 (the models' widths are).
//   - A part's output blocks are taken in groups of up to 512 KB of W, and x's rows in chunks of up to 256 KB,
//     so that a group's W and a chunk of x stay in L2 together; within them, output blocks two at a time (the
//     pair's W from L1 or L2 for every 32 rows of the chunk). A decode batch (up to 32 rows) is one chunk: W
//     streams from memory once.
//   - Measured (benchmarks/bench_linear.py, the default model's 121 matmuls, 2 cores of an Intel Xeon with
//     AMX): faster than oneDNN's AMX kernels up to 128 rows (1.3-1.7x at 16-64), 0.8-0.9x of them at 256-1024
//     rows. The gap at large M is in writing y: the same loop writing into a small buffer instead ran as fast
//     as oneDNN. The kernel plan (chapter 04c) picks per number of rows.
//   - C leaves the tiles through a 4 KB buffer on the stack: bias added, rounded to bf16 (nearest even, as
//     torch rounds), stored.
// Linux lends the tile registers' 8 KB of state to a process only when asked (arch_prctl
// ARCH_REQ_XCOMP_PERM); without that, the first tile instruction kills the process with SIGILL. amx_available()
// asks once; where the kernel refuses (or the CPU has no AMX) it says no and the plan never picks AMX.
#include <ATen/ATen.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <string>

#include "gemv.h"

#pragma GCC diagnostic ignored "-Wpsabi"

#if defined(__GNUC__) && defined(__x86_64__) && defined(__linux__)
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#define MINISGL_AMX 1
#endif

namespace minisgl {
namespace cpu {

#ifdef MINISGL_AMX
namespace {

constexpr long kArchReqXcompPerm = 0x1023;  // arch_prctl: ask for an XSAVE feature's state
constexpr int kXfeatureXtiledata = 18;      // the tile registers' data
constexpr int64_t kChunkBytes = 256 << 10;  // x's rows per chunk: at most this many bytes of them
constexpr int64_t kGroupBytes = 512 << 10;  // W's output blocks per group: at most this many bytes of them

// The CPU has AMX-TILE and AMX-BF16 (CPUID leaf 7: EDX bits 24 and 22) and AVX512-BF16 for the epilogue.
bool cpu_has_amx() {
  unsigned a, b, c, d;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
  __builtin_cpu_init();
  return (d >> 24 & 1) && (d >> 22 & 1) && __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512bw");
}

// ldtilecfg's 64-byte operand (palette 1): per tile, its rows and bytes per row.
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// The tiles of a block of r0 + r1 rows (r0 <= 16 in tmm0, 1 and 4; r1 <= 16 in tmm2, 3 and 5), loaded only when
// the thread's current configuration differs (ldtilecfg also zeroes the tiles).
#define MINISGL_TAMX __attribute__((target(MINISGL_AMX_ISA "avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))

thread_local int tile_config = -1;  // the key (r0, r1) of this thread's loaded configuration; -1: none

// Whether this thread's tile configuration is still loaded: code outside minisgl (oneDNN, behind torch's matmuls)
// runs on the same threads and may have released the tiles (TILERELEASE), after which a tile instruction is an
// invalid opcode. XINUSE (xgetbv 1) bit 17 says whether TILECFG is in use: a few cycles to read.
#ifdef MINISGL_AMX_EMULATE
inline bool tiles_still_configured() { return true; }   // nothing else runs emulated tiles
#else
__attribute__((target("xsave"))) inline bool tiles_still_configured() { return (_xgetbv(1) >> 17) & 1; }
#endif

MINISGL_TAMX void configure(int r0, int r1) {
  const int key = r0 * 32 + r1;
  if (tile_config >= 0 && !tiles_still_configured()) tile_config = -1;
  if (key == tile_config) return;
  // a block of one row tile leaves tmm2, 3 and 5 unused: the loaded configuration serves if its first rows match
  // (a 48-row batch alternated (16, 16) and (16, 0) at every pair of output blocks: ldtilecfg is not cheap)
  if (r1 == 0 && tile_config >= 0 && tile_config / 32 == r0) return;
  TileConfig cfg;
  const int rows[8] = {r0, r0, r1, r1, r0, r1, 16, 16};  // C00 C01 C10 C11 A0 A1 B0 B1
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = static_cast<uint8_t>(std::max(rows[t], 1));
    cfg.colsb[t] = 64;
  }
  // GCC does not see ldtilecfg read cfg: with constant rows it dropped the stores above (found as a SIGILL)
  __asm__ __volatile__("" : : "r"(&cfg) : "memory");
#ifdef MINISGL_AMX_EMULATE
  emulate::configure(r0, r1);
#else
  _tile_loadconfig(&cfg);
#endif
  tile_config = key;
}

// Sums of rows x[0, 16 + r1) (two tiles when TWO_M) times output blocks w0 (and w1 when TWO_N) over K = 32 *
// steps, into the tiles; then stored into c[4][16][16] (c[2 i + j]: rows tile i, outputs block j).
template <bool TWO_M, bool TWO_N>
MINISGL_TAMX inline void block(const uint16_t* x, int64_t xs, const uint16_t* w0, const uint16_t* w1, int64_t steps,
                               float (*c)[16][16]) {
  const int64_t xb = xs * 2;  // bytes per row of x
  _tile_zero(0);
  if (TWO_N) _tile_zero(1);
  if (TWO_M) _tile_zero(2);
  if (TWO_M && TWO_N) _tile_zero(3);
  for (int64_t s = 0; s < steps; ++s) {
    _tile_loadd(4, x + s * 32, xb);
    _tile_loadd(6, w0 + s * 512, 64);
    _tile_dpbf16ps(0, 4, 6);
    if (TWO_N) {
      _tile_loadd(7, w1 + s * 512, 64);
      _tile_dpbf16ps(1, 4, 7);
    }
    if (TWO_M) {
      _tile_loadd(5, x + 16 * xs + s * 32, xb);
      _tile_dpbf16ps(2, 5, 6);
      if (TWO_N) _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, c[0], 64);
  if (TWO_N) _tile_stored(1, c[1], 64);
  if (TWO_M) _tile_stored(2, c[2], 64);
  if (TWO_M && TWO_N) _tile_stored(3, c[3], 64);
}

// Rows [0, rows) of the fp32 sums of one output block (n0 = its first output) into y: bias, bf16, masked store.
MINISGL_TAMX inline void store_block(const float (*c)[16], int rows, const float* bias, void* y, int64_t ys,
                                     bool y_f32, int64_t N, int64_t n0) {
  const int64_t valid = std::min<int64_t>(16, N - n0);
  if (valid <= 0) return;
  const __mmask16 mk = valid == 16 ? (__mmask16)0xffff : (__mmask16)((1u << valid) - 1u);
  const __m512 b = bias ? _mm512_maskz_loadu_ps(mk, bias + n0) : _mm512_setzero_ps();
  for (int m = 0; m < rows; ++m) {
    const __m256bh r = _mm512_cvtneps_pbh(_mm512_add_ps(_mm512_load_ps(c[m]), b));  // round to nearest even
    if (y_f32) _mm512_mask_storeu_ps(static_cast<float*>(y) + m * ys + n0, mk, _mm512_cvtpbh_ps(r));
    else _mm256_mask_storeu_epi16(static_cast<uint16_t*>(y) + m * ys + n0, mk, (__m256i)r);
  }
}

}  // namespace

bool amx_available() {
  static const bool ok = [] {
    const char* cap = std::getenv("MINISGL_CPU_ISA");
    if (cap && *cap) return false;  // any cap is below AMX, the widest ISA here
#ifdef MINISGL_AMX_EMULATE
    return true;   // the tests' emulated tiles run on any CPU, with no state to ask Linux for
#endif
    if (!cpu_has_amx()) return false;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
}

MINISGL_TAMX void run_amx_part(const TilesPlan& p, const uint16_t* x, int64_t xs, int64_t M, void* y, int64_t ys,
                               bool y_f32, int64_t nb0, int64_t nb1) {
  const int64_t steps = p.K2 / 16, blk = p.K2 * 32;  // k steps of 32; elements per block of 16 outputs
  const int64_t chunk = std::max<int64_t>(32, kChunkBytes / (4 * p.K2) / 32 * 32);  // rows
  const int64_t group = std::max<int64_t>(2, kGroupBytes / (64 * p.K2) / 2 * 2);    // output blocks
  const size_t esz = y_f32 ? sizeof(float) : sizeof(uint16_t);
  alignas(64) float c[4][16][16];
  for (int64_t g0 = nb0; g0 < nb1; g0 += group) {
    const int64_t g1 = std::min(nb1, g0 + group);
    for (int64_t c0 = 0; c0 < M; c0 += chunk) {
      const int64_t c1 = std::min(M, c0 + chunk);
      for (int64_t nb = g0; nb < g1; nb += 2) {
        const bool two_n = nb + 1 < g1;
        const uint16_t* w0 = p.wp + nb * blk;
        for (int64_t m = c0; m < c1; m += 32) {
          const int r0 = static_cast<int>(std::min<int64_t>(16, c1 - m));
          const int r1 = static_cast<int>(std::min<int64_t>(16, std::max<int64_t>(0, c1 - m - 16)));
          configure(r0, r1);
          const uint16_t* xm = x + m * xs;
          if (r1 && two_n) block<true, true>(xm, xs, w0, w0 + blk, steps, c);
          else if (r1) block<true, false>(xm, xs, w0, nullptr, steps, c);
          else if (two_n) block<false, true>(xm, xs, w0, w0 + blk, steps, c);
          else block<false, false>(xm, xs, w0, nullptr, steps, c);
          char* ym = static_cast<char*>(y) + m * ys * esz;
          for (int j = 0; j < (two_n ? 2 : 1); ++j) {
            store_block(c[j], r0, p.bias, ym, ys, y_f32, p.N, (nb + j) * 16);
            if (r1) store_block(c[2 + j], r1, p.bias, ym + 16 * ys * esz, ys, y_f32, p.N, (nb + j) * 16);
          }
        }
      }
    }
  }
}

MINISGL_TAMX void amx_tiles_rows(int r0, int r1) { configure(r0, r1); }
MINISGL_TAMX void amx_tiles_16x64() { configure(16, 16); }

// Hands the tile state back (the thread's next ldtilecfg takes it again): a thread holding it makes every
// context switch save and restore 8 KB more. Plain code until it knows the thread holds tiles, so that it runs
// on any CPU.
#ifdef MINISGL_AMX_EMULATE
static void tile_release() {}
#else
MINISGL_TAMX static void tile_release() { _tile_release(); }
#endif

void release_amx() {
  if (tile_config < 0) return;
  tile_release();
  tile_config = -1;
}

#else
bool amx_available() { return false; }
void run_amx_part(const TilesPlan&, const uint16_t*, int64_t, int64_t, void*, int64_t, bool, int64_t, int64_t) {}
void amx_tiles_rows(int, int) {}
void amx_tiles_16x64() {}
void release_amx() {}
#endif

}  // namespace cpu
}  // namespace minisgl
