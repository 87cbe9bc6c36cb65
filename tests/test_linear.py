"""The decode GEMV (`minisgl._C.linear_gemv`, Python face `minisgl.linear.linear`) against `F.linear` in fp32.

Every ISA variant this machine has (forced through the op's `isa` argument), random shapes including K not
a multiple of the vector width and odd N, 1..8 rows (and more, which re-stream the weight), bias / no bias,
bf16 and fp32 x, strided rows; the `MINISGL_CPU_ISA` cap in a subprocess; the argument checks. And the batch
kernel over packed weights (`linear_packed`: AVX512-BF16 dot products, else the AVX2 body): random shapes,
prefill-sized row counts, exact rounding to nearest even, the model's shapes against the GEMV, the cap, its
argument checks. And the same packed weight on AMX (`linear_packed(..., amx=True)`, where the CPU has it): the same
checks, and AMX turned off cleanly by a cap or by a kernel that refuses the tile state."""
import itertools
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from minisgl import linear as L

HAS = L.gemv_available()
EXT = L.native()
needs_ext = pytest.mark.skipif(not HAS, reason="minisgl._C not built (pip install --no-build-isolation -e .)")
ORDER = ["baseline", "avx2", "avx512", "avx512bf16"]
ISAS = ORDER[: ORDER.index(L.native().linear_isa()) + 1] if HAS else []
# the packed tiles' bodies to test: the default, and the AVX-512 fp32 FMA one where it is another (`fma=True`)
FMA = [False] + ([True] if HAS and hasattr(EXT, "linear_fma_available") and EXT.linear_fma_available() else [])


def ref(x, w, b):
    return F.linear(x.float(), w.float(), None if b is None else b.float())


def close(y, r, K, dtype):
    # fp32 sums in another order, then one rounding to x's dtype
    atol = 1e-4 * K**0.5 if dtype == torch.float32 else 2e-2 * K**0.5
    rtol = 1e-4 if dtype == torch.float32 else 1.6e-2
    torch.testing.assert_close(y.float(), r, atol=atol, rtol=rtol)


@needs_ext
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("seed", range(6))
def test_random_shapes(isa, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    for M in range(1, 9):
        N = int(torch.randint(1, 300, (1,), generator=g)) | 1  # odd N
        K = int(torch.randint(1, 1100, (1,), generator=g))
        if seed % 2 == 0: K = K // 32 * 32 + 31               # K not a multiple of 32 (nor of 16 or 8)
        w = torch.randn(N, K, generator=g).bfloat16()
        b = torch.randn(N, generator=g).bfloat16() if (seed + M) % 2 else None
        stride = K + int(torch.randint(0, 40, (1,), generator=g))
        x = torch.randn(M, stride, generator=g).to(dtype)[:, :K]  # strided rows
        y = L.native().linear_gemv(x, w, b, isa)
        assert y.dtype == dtype and y.shape == (M, N) and y.is_contiguous()
        close(y, ref(x, w, b), K, dtype)


@needs_ext
@pytest.mark.parametrize("isa", ISAS)
def test_model_shapes_and_many_rows(isa):
    g = torch.Generator().manual_seed(1)
    for N, K in [(960, 576), (576, 1536), (3072, 576)]:
        w = torch.randn(N, K, generator=g).bfloat16()
        for M in (1, 2, 8, 13):  # 13 rows: two passes over W
            x = torch.randn(M, K, generator=g).bfloat16()
            close(L.native().linear_gemv(x, w, None, isa), ref(x, w, None), K, torch.bfloat16)


@needs_ext
def test_edge_cases():
    ext = L.native()
    w = torch.randn(5, 7).bfloat16()
    assert ext.linear_gemv(torch.randn(0, 7).bfloat16(), w).shape == (0, 5)
    b = torch.randn(4).bfloat16()
    y = ext.linear_gemv(torch.randn(2, 0), torch.randn(4, 0).bfloat16(), b)
    torch.testing.assert_close(y, b.float().expand(2, 4))
    xt = torch.randn(7, 3).bfloat16().t()  # last dim not contiguous
    close(ext.linear_gemv(xt, w), ref(xt, w, None), 7, torch.bfloat16)
    with pytest.raises(RuntimeError, match="weight must be bfloat16"): ext.linear_gemv(torch.randn(1, 7), w.float())
    with pytest.raises(RuntimeError, match="K=7"): ext.linear_gemv(torch.randn(1, 6), w)
    with pytest.raises(RuntimeError, match="bias must be"): ext.linear_gemv(torch.randn(1, 7), w, torch.randn(4))
    with pytest.raises(RuntimeError, match="isa must be"): ext.linear_gemv(torch.randn(1, 7), w, None, "sse9")


def test_python_face():
    w = torch.randn(40, 33).bfloat16()
    b = torch.randn(40).bfloat16()
    for shape in [(33,), (1, 33), (2, 33), (1, 2, 33), (3, 4, 33)]:  # GEMV up to GEMV_MAX_ROWS rows, else torch
        for dtype in (torch.bfloat16, torch.float32):
            x = torch.randn(*shape).to(dtype)
            y = L.linear(x, w, b)
            assert y.shape == (*shape[:-1], 40) and y.dtype == dtype
            close(y, L.linear_ref(x, w, b).float(), 33, torch.bfloat16)
    with pytest.raises(ValueError, match="x must end in in_features=33"): L.linear(torch.randn(2, 5), w)
    with pytest.raises(ValueError, match="weight must be 2-D"): L.linear(torch.randn(2, 5), torch.randn(5))
    with pytest.raises(ValueError, match="bias must be"): L.linear(torch.randn(2, 33), w, torch.randn(3))
    with pytest.raises(TypeError, match="x must be a Tensor"): L.linear([1.0], w)


@needs_ext
@pytest.mark.parametrize("cap,want", [("baseline", "baseline"), ("avx2", "avx2"), ("avx512", "avx512")])
def test_env_cap(cap, want):
    if want not in ISAS: pytest.skip(f"{want} not available here")
    code = ("import torch, torch.nn.functional as F; from minisgl import _C; print(_C.linear_isa());"
            "w = torch.randn(9, 45).bfloat16(); x = torch.randn(3, 45).bfloat16();"
            "torch.testing.assert_close(_C.linear_gemv(x, w).float(), F.linear(x.float(), w.float()), atol=0.2, rtol=0.02)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env={**os.environ, "MINISGL_CPU_ISA": cap}, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split()[0] == want


# ---------------------------------------------------------------- linear_packed (csrc/cpu/gemm_bf16.cpp)
needs_tiles = pytest.mark.skipif(EXT is None or not hasattr(EXT, "linear_packed") or not EXT.linear_packed_available(),
                                 reason="linear_packed needs the extension and an x86 CPU with AVX2 and FMA")


@needs_tiles
@pytest.mark.parametrize("seed", range(8))
def test_packed_random_shapes(seed):
    "Any M (tails of the 8-row tiles), N (tails of the 16- and 48-column blocks), even K; strided x; bias or not."
    g = torch.Generator().manual_seed(seed)
    M = int(torch.randint(1, 80, (1,), generator=g))
    N = int(torch.randint(1, 200, (1,), generator=g))
    K = 2 * int(torch.randint(1, 400, (1,), generator=g))
    x = torch.randn(M, K + 6, generator=g).bfloat16()[:, 3:K + 3]
    w, b = torch.randn(N, K, generator=g).bfloat16(), torch.randn(N, generator=g).bfloat16()
    p = EXT.pack_linear_weight(w)
    for bias, fma in itertools.product((None, b), FMA):
        y = EXT.linear_packed(x, p, N, bias, fma=fma)
        assert y.dtype == torch.bfloat16 and y.shape == (M, N)
        ref = (x.float() @ w.float().T + (0 if bias is None else bias.float())).bfloat16()
        torch.testing.assert_close(y.float(), ref.float(), atol=2e-2 * K ** 0.5, rtol=1.6e-2)


@needs_tiles
def test_packed_model_shapes_match_gemv():
    "On the default model's shapes, 1 to 64 rows: tiles and GEMV agree to bf16 rounding (both sum in fp32)."
    torch.manual_seed(0)
    for n, k in [(960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576)]:
        w = torch.randn(n, k).bfloat16()
        p = EXT.pack_linear_weight(w)
        for m, fma in itertools.product((1, 3, 8, 33, 64), FMA):
            x = torch.randn(m, k).bfloat16()
            torch.testing.assert_close(EXT.linear_packed(x, p, n, fma=fma).float(),
                                       EXT.linear_gemv(x, w, None, "").float(), atol=1e-2 * k ** 0.5, rtol=1.6e-2)


@needs_tiles
@pytest.mark.parametrize("K", [576, 1536])
def test_packed_many_rows(K):
    "Prefill-sized M: the widening bodies take x in chunks of rows (AVX2: 108 at K=576, 42 at K=1536; AVX-512: 112, 40)."
    torch.manual_seed(K)
    for M, fma in itertools.product((39, 40, 41, 107, 108, 109, 111, 112, 113, 300, 701), FMA):
        x, w, b = torch.randn(M, K).bfloat16(), torch.randn(50, K).bfloat16(), torch.randn(50).bfloat16()
        y = EXT.linear_packed(x, EXT.pack_linear_weight(w), 50, b, fma=fma)
        ref = (x.float() @ w.float().T + b.float()).bfloat16()
        torch.testing.assert_close(y.float(), ref.float(), atol=2e-2 * K ** 0.5, rtol=1.6e-2)


@needs_tiles
def test_packed_rounds_to_nearest_even():
    "Small integers multiply and sum exactly in fp32, so the output must be torch's bf16 rounding of the exact sum, bit for bit."
    g = torch.Generator().manual_seed(0)
    x = torch.randint(-7, 8, (37, 64), generator=g).float()
    w = torch.randint(-7, 8, (45, 64), generator=g).float()
    b = torch.randint(-300, 300, (45,), generator=g).bfloat16()   # the bias as the kernel gets it
    exact = (x.double() @ w.double().T + b.double()).float()
    assert (exact.abs() > 256).any()   # where bf16 cannot hold every integer: ties are rounded to even
    for fma in FMA:
        y = EXT.linear_packed(x.bfloat16(), EXT.pack_linear_weight(w.bfloat16()), 45, b, fma=fma)
        assert torch.equal(y, exact.bfloat16()), fma


@needs_ext
@pytest.mark.parametrize("cap,want", [("", None), ("avx512", "avx512"), ("avx2", "avx2"), ("baseline", "none")])
def test_packed_env_cap(cap, want):
    "MINISGL_CPU_ISA caps the tiles' body as it caps the GEMV: avx512 and avx2 run the widening body on zmm or ymm, baseline none."
    code = ("import torch; from minisgl import _C; print(_C.linear_packed_isa(), _C.linear_packed_available(), _C.linear_fma_available());"
            "w = torch.randn(40, 96).bfloat16(); x = torch.randn(13, 96).bfloat16();"
            "ok = not _C.linear_packed_available() or torch.allclose(_C.linear_packed(x, _C.pack_linear_weight(w), 40).float(),"
            " (x.float() @ w.float().T), atol=0.3, rtol=0.02); assert ok\n"
            "if not _C.linear_fma_available():\n"
            "    try: _C.linear_packed(x, _C.pack_linear_weight(w), 40, fma=True); assert False, 'fma ran'\n"
            "    except RuntimeError as e: assert 'does not run here' in str(e) or 'AVX2' in str(e), e")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env={**os.environ, "MINISGL_CPU_ISA": cap}, timeout=120)
    assert r.returncode == 0, r.stderr
    isa, available, fma = r.stdout.split()
    assert available == str(isa != "none")
    assert fma == str(isa in ("avx512", "avx512bf16"))   # the FMA body on zmm runs wherever AVX-512 is not capped
    if want is None:   # uncapped: the widest body this CPU has
        assert isa == ("avx512bf16" if "avx512bf16" in ISAS else "avx2" if "avx2" in ISAS else "none")
    elif want == "none" or want in ISAS: assert isa == want


@needs_tiles
def test_packed_errors():
    w = torch.randn(20, 8).bfloat16()
    p = EXT.pack_linear_weight(w)
    x = torch.randn(3, 8).bfloat16()
    with pytest.raises(RuntimeError, match="even"): EXT.pack_linear_weight(torch.randn(4, 5).bfloat16())
    with pytest.raises(RuntimeError, match="bfloat16"): EXT.pack_linear_weight(torch.randn(4, 4))
    with pytest.raises(RuntimeError, match="N=40"): EXT.linear_packed(x, p, 40)
    with pytest.raises(RuntimeError, match="K=8"): EXT.linear_packed(torch.randn(3, 6).bfloat16(), p, 20)
    with pytest.raises(RuntimeError, match="bfloat16"): EXT.linear_packed(x.float(), p, 20)
    with pytest.raises(RuntimeError, match="bias"): EXT.linear_packed(x, p, 20, torch.randn(7))
    with pytest.raises(RuntimeError, match="pack_linear_weight"): EXT.linear_packed(x, w, 20)
    assert EXT.linear_packed(x[:0], p, 20).shape == (0, 20)
    with pytest.raises(RuntimeError, match="at most one"): EXT.linear_packed(x, p, 20, None, True, True)


# ---------------------------------------------------------------- linear_packed on AMX (csrc/cpu/gemm_amx.cpp)
needs_amx = pytest.mark.skipif(not L.amx_available(), reason="no AMX-BF16 on this CPU (or the OS refused its tile state)")


@needs_amx
@pytest.mark.parametrize("seed", range(6))
def test_amx_random_shapes(seed):
    "Any M (tails of the 16- and 32-row blocks), N (a lone last block), K a multiple of 32; strided x; bias or not."
    g = torch.Generator().manual_seed(seed)
    M = int(torch.randint(1, 300, (1,), generator=g))
    N = int(torch.randint(1, 200, (1,), generator=g))
    K = 32 * int(torch.randint(1, 40, (1,), generator=g))
    x = torch.randn(M, K + 6, generator=g).bfloat16()[:, 3:K + 3]
    w, b = torch.randn(N, K, generator=g).bfloat16(), torch.randn(N, generator=g).bfloat16()
    p = EXT.pack_linear_weight(w)
    for bias in (None, b):
        y = EXT.linear_packed(x, p, N, bias, True)
        assert y.dtype == torch.bfloat16 and y.shape == (M, N)
        torch.testing.assert_close(y.float(), ref(x, w, bias).bfloat16().float(), atol=2e-2 * K ** 0.5, rtol=1.6e-2)


@needs_amx
@pytest.mark.parametrize("K", [576, 1536])
def test_amx_chunks_and_groups(K):
    """Row counts around the chunks of x (224 rows at K=576, 64 at K=1536) and enough outputs for several groups of
    W (28 and 10 blocks): the AMX body and the dot-product body agree to bf16 rounding everywhere."""
    torch.manual_seed(K)
    w = torch.randn(1000, K).bfloat16()
    p = EXT.pack_linear_weight(w)
    for M in (1, 31, 32, 63, 64, 65, 223, 224, 225, 450):
        x = torch.randn(M, K).bfloat16()
        torch.testing.assert_close(EXT.linear_packed(x, p, 1000, None, True).float(), EXT.linear_packed(x, p, 1000).float(),
                                   atol=1e-2 * K ** 0.5, rtol=1.6e-2)


@needs_amx
def test_amx_rounds_to_nearest_even():
    "Small integers multiply and sum exactly in fp32, so the AMX body's output is torch's bf16 rounding of the exact sum, bit for bit."
    g = torch.Generator().manual_seed(0)
    x = torch.randint(-7, 8, (37, 64), generator=g).float()
    w = torch.randint(-7, 8, (45, 64), generator=g).float()
    b = torch.randint(-300, 300, (45,), generator=g).bfloat16()
    exact = (x.double() @ w.double().T + b.double()).float()
    y = EXT.linear_packed(x.bfloat16(), EXT.pack_linear_weight(w.bfloat16()), 45, b, True)
    assert torch.equal(y, exact.bfloat16())


AMX_PROBE = ("import torch; from minisgl import _C; from minisgl.linear import amx_available, kernel_runs;"
             "print(_C.linear_amx_available(), amx_available(), kernel_runs('amx', 8, 576));"
             "p = _C.pack_linear_weight(torch.randn(40, 96).bfloat16()); x = torch.randn(13, 96).bfloat16();"
             "assert _C.linear_packed(x, p, 40).shape == (13, 40)\n"   # the other bodies still run
             "try: _C.linear_packed(x, p, 40, None, True)\n"
             "except RuntimeError as e: print('refused:', e)")


@needs_tiles
def test_amx_capped():
    "Any MINISGL_CPU_ISA cap turns the AMX body off (the capped plans of the benchmarks imitate a CPU without AMX)."
    r = subprocess.run([sys.executable, "-c", AMX_PROBE], capture_output=True, text=True,
                       env={**os.environ, "MINISGL_CPU_ISA": "avx512bf16"}, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[0] == "False False False"
    assert "AMX does not run here" in r.stdout


SECCOMP_C = r"""
#include <errno.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <stddef.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <unistd.h>
/* Runs argv[1:] with arch_prctl(ARCH_REQ_XCOMP_PERM, ...) failing with EPERM, as on a kernel that refuses AMX. */
int main(int argc, char** argv) {
  struct sock_filter f[] = {
      BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, nr)),
      BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, SYS_arch_prctl, 0, 3),
      BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, args[0])),
      BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, 0x1023, 0, 1),
      BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | EPERM),
      BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
  };
  struct sock_fprog prog = {sizeof f / sizeof f[0], f};
  if (argc < 2 || prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) || prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &prog)) return 126;
  execvp(argv[1], argv + 1);
  return 127;
}
"""


@needs_tiles
@pytest.mark.skipif(sys.platform != "linux", reason="arch_prctl and seccomp are Linux's")
def test_amx_refused_by_the_kernel(tmp_path):
    """Where Linux refuses the tile state, the extension says AMX does not run and the plan never offers it: no
    SIGILL. Run for real under a seccomp filter that makes that one arch_prctl call fail."""
    src, exe = tmp_path / "no_amx.c", tmp_path / "no_amx"
    src.write_text(SECCOMP_C)
    subprocess.run(["gcc", "-O1", str(src), "-o", str(exe)], check=True, capture_output=True)
    r = subprocess.run([str(exe), sys.executable, "-c", AMX_PROBE], capture_output=True, text=True,
                       env={**os.environ, "MINISGL_CPU_ISA": ""}, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[0] == "False False False"
    assert "AMX does not run here" in r.stdout
