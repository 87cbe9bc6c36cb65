// isa.h -- the instruction set the CPU kernels run (attention.cpp, fused.cpp), picked once at run time, and
// RowKernel, which compiles one row kernel for each of them.
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

// Which of three variants runs here: `avx512` from AVX-512 up, `avx2`, else `base`.
template <typename Fn>
Fn for_isa(Fn avx512, Fn avx2, Fn base) {
  const Isa isa = best_isa();
  return isa >= Isa::avx512 ? avx512 : isa == Isa::avx2 ? avx2 : base;
}

// A row kernel written once as plain loops (`Body`, an inline function), compiled three times: for AVX-512, for
// AVX2 + FMA and for the baseline, each with `Body` inlined (flatten) so that its loops vectorise for that ISA.
// `RowKernel<body>::pick()` is the variant for this CPU, chosen once.
template <auto Body>
struct RowKernel;

template <typename... A, void (*Body)(A...)>
struct RowKernel<Body> {
  using Fn = void (*)(A...);
#if defined(__GNUC__) && defined(__x86_64__)
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma"), flatten)) static void avx512(A... a) {
    Body(a...);
  }
  __attribute__((target("avx2,fma"), flatten)) static void avx2(A... a) { Body(a...); }
#endif
  static void base(A... a) { Body(a...); }

  static Fn pick() {
#if defined(__GNUC__) && defined(__x86_64__)
    static const Fn f = for_isa<Fn>(avx512, avx2, base);
    return f;
#else
    return base;
#endif
  }

  // The name of the variant `pick()` runs: "avx512", "avx2" or "baseline".
  static std::string picked() {
#if defined(__GNUC__) && defined(__x86_64__)
    if (pick() == avx512) return "avx512";
    if (pick() == avx2) return "avx2";
#endif
    return "baseline";
  }
};

}  // namespace minisgl::cpu
