"""The AMX code on a CPU without AMX: the whole extension compiled with -DMINISGL_AMX_EMULATE, where the four tile
instructions are scalar C++ that honours each tile's configured rows (csrc/cpu/amx_emulate.h) and AMX counts as
available. So the AMX bodies' own logic (the tiles they build, the rows they load, what they store) is checked here
as the chapters check the real ones where AMX exists: `qamx` (csrc/cpu/quant.cpp) on every format against the
product of x and the dequantized weight rounded to bf16, within bf16's rounding; the decode and extend attention
(csrc/cpu/attention_amx.h) against the torch reference over random paged requests (GQA groups of 1 to 16 heads,
requests long enough to be split into tasks, sliding windows) and for the same bits in any batch; and, with the
build loaded as `minisgl._C` in a process of its own, the engine's paths over AMX: the packed tiles (gemm_amx.cpp)
and `qamx` inside the one-call decode step. The code around the tiles uses AVX512-BF16 and VNNI, so the test needs
those."""
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from minisgl.kernels import decode_attention_torch, extend_attention_torch, make_paged_batch, native
from minisgl.linear import _cpu_model_and_flags   # the kernel plan's reading of /proc/cpuinfo
from minisgl.linear import wrong_outputs
from minisgl.quant import FORMAT_BY_TYPE, QUANT_FORMATS, QuantLinear, quantize_int8, random_gguf_rows, repack

CPU = Path(__file__).resolve().parent.parent / "csrc" / "cpu"

pytestmark = pytest.mark.skipif(not {"avx512_bf16", "avx512_vnni"} <= set(_cpu_model_and_flags()[1]),
                                reason="the emulated AMX kernels still dequantize with AVX512-BF16 and VNNI")


@pytest.fixture(scope="module")
def emulated(tmp_path_factory):
    "The whole extension (setup.py's sources, -O1) on emulated tiles: the module, its file beside it in `.path`."
    from torch.utils.cpp_extension import load
    d = tmp_path_factory.mktemp("extension_amx_emulated")
    sources = [str(CPU.parent / "bindings.cpp")] + sorted(str(p) for p in CPU.glob("*.cpp"))
    ext = load("_C", sources, extra_include_paths=[str(CPU), str(CPU.parent)], extra_ldflags=["-fopenmp"],
               extra_cflags=["-O1", "-g0", "-std=c++17", "-fopenmp", "-fno-trapping-math", "-DMINISGL_AMX_EMULATE"],
               build_directory=str(d), verbose=False)
    assert ext.linear_amx_available() and ext.quant_amx_available()
    ext.path = d / "_C.so"
    return ext


def check(ext, w, qtype, x, bias, k):
    wd = native().quant_dequantize(w, qtype, k).bfloat16().double()
    ref = x.double() @ wd.T + (0 if bias is None else bias.double())
    y = ext.quant_linear(x, [w], [qtype], bias, 2).double()
    slack = 2 ** -7 * (x.double().abs() @ wd.abs().T + (0 if bias is None else bias.double().abs())) + 1e-6
    assert ((y - ref).abs() <= slack).all(), (qtype, tuple(x.shape), (y - ref).abs().max().item())
    # and the kernel plan's own check (chapter quant) would keep it: an AMX CPU will not drop a right qamx
    assert wrong_outputs(y, QuantLinear(k, [(FORMAT_BY_TYPE[qtype], w)], bias).expected("qamx", x)) is None


@pytest.mark.parametrize("name", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"])
def test_every_format(emulated, name):
    fmt = QUANT_FORMATS[name]
    for n, rows in ((48, 1), (32, 17), (16, 64), (16, 70)):   # a tail of 16 rows of x; past 64 rows (two chunks)
        w = torch.from_numpy(repack(fmt, random_gguf_rows(fmt, n, 512, seed=rows), 512))
        check(emulated, w, fmt.qtype, torch.randn(rows, 512).bfloat16(), torch.randn(n), 512)


def test_int8(emulated):
    check(emulated, quantize_int8(torch.randn(48, 256)), 100, torch.randn(20, 256).bfloat16(), None, 256)


def _exact(batch):
    return {k: v.float() if isinstance(v, torch.Tensor) and v.is_floating_point() else v for k, v in batch.items()}


@pytest.mark.parametrize("heads", [(4, 4), (9, 3), (16, 2), (32, 2)])   # GQA groups of 1, 3, 8 and 16 query heads
def test_attention_bodies(emulated, heads):
    """Decode (head_dim 64: the decode body's only size) over requests of 1 to 1100 tokens (a 1100-token request is
    split into tasks of at least 512 keys), extend (head_dim 64 and 128) of a fresh prompt, a short one and one on
    57 cached tokens; pages of 1 and 16 tokens in random order; with and without a sliding window. Each within the
    engine's own check at start-up (`wrong_outputs`) of the fp32 reference."""
    Hq, Hkv = heads
    args = ("q", "k_cache", "v_cache", "page_table", "table_idx", "seq_lens")
    for page in (1, 16):
        for w in (-1, 40):
            b = make_paged_batch([1, 17, 300, 1100], page=page, Hq=Hq, Hkv=Hkv, D=64, dtype=torch.bfloat16, seed=Hq)
            got = emulated.decode_attention(*[b[k] for k in args], b["scale"], w)
            assert wrong_outputs(got.reshape(-1, 64), decode_attention_torch(**_exact(b), sliding_window=w).reshape(-1, 64)) is None
            for D in (64, 128):
                b = make_paged_batch([140, 5, 90], [140, 5, 33], page=page, Hq=Hq, Hkv=Hkv, D=D, dtype=torch.bfloat16, seed=Hq)
                got = emulated.extend_attention(*[b[k] for k in args], b["extend_lens"], b["scale"], w)
                ref = extend_attention_torch(**_exact(b), sliding_window=w)
                assert wrong_outputs(got.reshape(-1, D), ref.reshape(-1, D)) is None, (page, w, D)


def test_attention_bodies_give_a_request_the_same_bits_in_any_batch(emulated):
    """As the other bodies do (tests/test_mixed_batches.py): a request's decode attention is the same bits alone and
    beside others (its keys are cut by its length alone), a mixed step's decode row (an extend of one query) is the
    same bits as that request's decode, and a prompt's extend rows are the same alone and beside others."""
    args = ("q", "k_cache", "v_cache", "page_table", "table_idx", "seq_lens")
    def decode(b, rows=slice(None), q=None):
        return emulated.decode_attention(b["q"][rows] if q is None else q, b["k_cache"], b["v_cache"],
                                                   b["page_table"], b["table_idx"][rows], b["seq_lens"][rows], b["scale"], -1)
    b = make_paged_batch([1, 17, 300, 1100], page=16, Hq=9, Hkv=3, D=64, dtype=torch.bfloat16, seed=5)
    together = decode(b)
    for i in range(4): assert torch.equal(decode(b, slice(i, i + 1))[0], together[i]), i
    e = make_paged_batch([140, 300, 90], [140, 1, 33], page=16, Hq=9, Hkv=3, D=64, dtype=torch.bfloat16, seed=6)
    out = emulated.extend_attention(*[e[k] for k in args], e["extend_lens"], e["scale"], -1)
    assert torch.equal(out[140], decode(e, slice(1, 2), e["q"][140:141])[0])   # the decode row of the step
    alone = emulated.extend_attention(e["q"][:140], e["k_cache"], e["v_cache"], e["page_table"], e["table_idx"][:1],
                                                e["seq_lens"][:1], e["extend_lens"][:1], e["scale"], -1)
    assert torch.equal(alone, out[:140])


RUNNER = """import importlib.util, sys
import torch   # its libraries first: the module links against them
spec = importlib.util.spec_from_file_location('minisgl._C', sys.argv[1])
ext = importlib.util.module_from_spec(spec); spec.loader.exec_module(ext)
sys.modules['minisgl._C'] = ext
from minisgl.kernels import native
from minisgl.linear import amx_available
from minisgl.quant import quant_kernel_runs
assert native() is ext and amx_available() and quant_kernel_runs('qamx', torch.bfloat16)
import pytest
sys.exit(pytest.main(sys.argv[2:]))
"""


def test_engine_paths_on_emulated_amx(emulated):
    """The whole extension on emulated tiles, loaded as `minisgl._C` in a process of its own, where `amx_available()`
    is true: the tests that cover the AMX paths where a CPU has AMX run them here. The one-call decode step over the
    AMX tiles gives the Python loop's bits, and a whole forward the torch reference's logits (tests/test_decode_layers.py:
    llama and qwen2, 1 to 64 rows); the one-call step with `qamx` in every linear of the embedded model gives the
    separate calls' bits (tests/test_quant.py); the `amx` candidate gives the reference's answer (tests/test_kernel_plan.py)."""
    root = CPU.parent.parent
    r = subprocess.run([sys.executable, "-c", RUNNER, str(emulated.path), "-q", "-p", "no:cacheprovider", "-rs",
                        "-k", "amx or one_call", "tests/test_decode_layers.py::test_native_over_packed_tiles",
                        "tests/test_quant.py::test_one_call_decode_step_equals_the_separate_calls",
                        "tests/test_kernel_plan.py::test_candidate_matches_reference"],
                       cwd=root, capture_output=True, text=True, timeout=1200)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    last = r.stdout.strip().splitlines()[-1]
    assert "14 passed" in last and "skipped" not in last, last   # 12 AMX bodies of the decode step, qamx's step, amx
