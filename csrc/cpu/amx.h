// amx.h -- what the AMX kernels share (gemm_amx.cpp): whether AMX runs here, one thread's tile configuration, and
// handing the tile state back.
#pragma once

namespace minisgl {
namespace cpu {

// Whether AMX runs here: the CPU has AMX-TILE and AMX-BF16, Linux lent this process the tile state (asked once,
// arch_prctl ARCH_REQ_XCOMP_PERM), and MINISGL_CPU_ISA does not cap it.
bool amx_available();
// Configures this thread's eight tiles as 16 rows x 64 bytes (a no-op when they already are).
void amx_tiles_16x64();
// Configures them as gemm_amx.cpp's blocks: tmm0, tmm1 and tmm4 hold r0 rows, tmm2, tmm3 and tmm5 r1 rows (1 to 16;
// 0 counts as 1), tmm6 and tmm7 16 rows; 64 bytes per row.
void amx_tiles_rows(int r0, int r1);
// Hands the tile state back; a thread that ran AMX code calls it when it is done (a no-op when it holds none).
void release_amx();

}  // namespace cpu
}  // namespace minisgl

// The target features of code that runs tile instructions (with the AVX-512 ones each body names after it): AMX's,
// except in the tests' emulated build (-DMINISGL_AMX_EMULATE, tests/test_amx_emulated.py), where amx_emulate.h
// writes the tile instructions in scalar C++ and is included here, for every AMX body alike.
#ifdef MINISGL_AMX_EMULATE
#include "amx_emulate.h"
#define MINISGL_AMX_ISA ""
#else
#define MINISGL_AMX_ISA "amx-tile,amx-bf16,"
#endif
