// isa.h -- the instruction set the CPU kernels run (attention.cpp, fused.cpp), picked once at run time.
//
// MINISGL_CPU_ISA=avx512|avx2|baseline caps the choice (to test the narrower variants on a wide machine);
// avx512bf16 is avx512 plus bf16 dot products (`vdpbf16ps`), which only some kernel bodies use. AMX (the tiles'
// other body, gemm_amx.cpp) is above them all: any cap turns it off.
#pragma once
#include <cstdlib>
#include <string>

namespace minisgl::cpu {

enum class Isa { base, avx2, avx512, avx512bf16 };

inline Isa best_isa() {
#if defined(__GNUC__) && defined(__x86_64__)
  static const Isa isa = [] {
    __builtin_cpu_init();
    const char* cap = std::getenv("MINISGL_CPU_ISA");
    const std::string want = cap ? cap : "";
    const bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
    const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    if (avx512 && __builtin_cpu_supports("avx512bf16") && (want.empty() || want == "avx512bf16"))
      return Isa::avx512bf16;
    if (avx512 && want != "avx2" && want != "baseline") return Isa::avx512;
    if (avx2 && want != "baseline") return Isa::avx2;
    return Isa::base;
  }();
  return isa;
#else
  return Isa::base;
#endif
}

}  // namespace minisgl::cpu
