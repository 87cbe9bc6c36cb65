"""The AMX bodies on a CPU without AMX: the quantized linears' kernel (`qamx`, csrc/cpu/quant.cpp) and the bf16 decode
and extend attention (csrc/cpu/attention_amx.h), compiled with -DMINISGL_AMX_EMULATE, where the four tile instructions
they use are scalar C++ that honours the configured rows of each tile (csrc/cpu/amx_emulate.h). So the kernels' own
logic (the tiles they build, the rows they load, what they store) is checked here as the chapters check the real
ones where AMX exists: `qamx` on every format against the product of x and the dequantized weight rounded to bf16,
within bf16's rounding; attention against the torch reference over random paged requests (GQA groups of 1 to 16
heads, requests long enough to be split into tasks, sliding windows). The rest of the code around the tiles uses
AVX512-BF16 and VNNI, so the test needs those."""
from pathlib import Path

import pytest
import torch

from minisgl.kernels import decode_attention_torch, extend_attention_torch, make_paged_batch, native
from minisgl.linear import _cpu_model_and_flags   # the kernel plan's reading of /proc/cpuinfo
from minisgl.linear import wrong_outputs
from minisgl.quant import FORMAT_BY_TYPE, QUANT_FORMATS, QuantLinear, quantize_int8, random_gguf_rows, repack

CPU = Path(__file__).resolve().parent.parent / "csrc" / "cpu"

pytestmark = pytest.mark.skipif(not {"avx512_bf16", "avx512_vnni"} <= set(_cpu_model_and_flags()[1]),
                                reason="the emulated AMX kernel still dequantizes with AVX512-BF16 and VNNI")


@pytest.fixture(scope="module")
def emulated(tmp_path_factory):
    from torch.utils.cpp_extension import load
    d = tmp_path_factory.mktemp("amx_emulated")
    binding = d / "binding.cpp"
    binding.write_text('#include <torch/extension.h>\n#include "quant.h"\n'
                       'PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("quant_linear", &minisgl::quant_linear_cpu); }\n')
    return load("minisgl_amx_emulated", [str(binding), str(CPU / "quant.cpp")], extra_include_paths=[str(CPU)],
                extra_cflags=["-O1", "-g0", "-std=c++17", "-DMINISGL_AMX_EMULATE"], build_directory=str(d), verbose=False)


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


@pytest.fixture(scope="module")
def emulated_attention(tmp_path_factory):
    "attention.cpp with its AMX bodies on emulated tiles, and what gemm_amx.cpp gives it (AMX here, its configurations)."
    from torch.utils.cpp_extension import load
    d = tmp_path_factory.mktemp("amx_attention_emulated")
    binding = d / "binding.cpp"
    binding.write_text("""#include <torch/extension.h>
#include "amx_emulate.h"
#include "ops.h"
namespace minisgl { namespace cpu {
bool amx_available() { return true; }
void amx_tiles_16x64() { emulate::configure(16, 16); }
void amx_tiles_rows(int r0, int r1) { emulate::configure(r0, r1); }
void release_amx() {}
}}
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode_attention", &minisgl::decode_attention_cpu);
  m.def("extend_attention", &minisgl::extend_attention_cpu);
}
""")
    return load("minisgl_amx_attention_emulated", [str(binding), str(CPU / "attention.cpp")],
                extra_include_paths=[str(CPU), str(CPU.parent)], extra_cflags=["-O1", "-g0", "-std=c++17", "-DMINISGL_AMX_EMULATE"],
                build_directory=str(d), verbose=False)


def _exact(batch):
    return {k: v.float() if isinstance(v, torch.Tensor) and v.is_floating_point() else v for k, v in batch.items()}


@pytest.mark.parametrize("heads", [(4, 4), (9, 3), (16, 2), (32, 2)])   # GQA groups of 1, 3, 8 and 16 query heads
def test_attention_bodies(emulated_attention, heads):
    """Decode (head_dim 64: the decode body's only size) over requests of 1 to 1100 tokens (a 1100-token request is
    split into tasks of at least 512 keys), extend (head_dim 64 and 128) of a fresh prompt, a short one and one on
    57 cached tokens; pages of 1 and 16 tokens in random order; with and without a sliding window. Each within the
    engine's own check at start-up (`wrong_outputs`) of the fp32 reference."""
    Hq, Hkv = heads
    args = ("q", "k_cache", "v_cache", "page_table", "table_idx", "seq_lens")
    for page in (1, 16):
        for w in (-1, 40):
            b = make_paged_batch([1, 17, 300, 1100], page=page, Hq=Hq, Hkv=Hkv, D=64, dtype=torch.bfloat16, seed=Hq)
            got = emulated_attention.decode_attention(*[b[k] for k in args], b["scale"], w)
            assert wrong_outputs(got.reshape(-1, 64), decode_attention_torch(**_exact(b), sliding_window=w).reshape(-1, 64)) is None
            for D in (64, 128):
                b = make_paged_batch([140, 5, 90], [140, 5, 33], page=page, Hq=Hq, Hkv=Hkv, D=D, dtype=torch.bfloat16, seed=Hq)
                got = emulated_attention.extend_attention(*[b[k] for k in args], b["extend_lens"], b["scale"], w)
                ref = extend_attention_torch(**_exact(b), sliding_window=w)
                assert wrong_outputs(got.reshape(-1, D), ref.reshape(-1, D)) is None, (page, w, D)


def test_attention_bodies_give_a_request_the_same_bits_in_any_batch(emulated_attention):
    """As the other bodies do (tests/test_mixed_batches.py): a request's decode attention is the same bits alone and
    beside others (its keys are cut by its length alone), a mixed step's decode row (an extend of one query) is the
    same bits as that request's decode, and a prompt's extend rows are the same alone and beside others."""
    args = ("q", "k_cache", "v_cache", "page_table", "table_idx", "seq_lens")
    def decode(b, rows=slice(None), q=None):
        return emulated_attention.decode_attention(b["q"][rows] if q is None else q, b["k_cache"], b["v_cache"],
                                                   b["page_table"], b["table_idx"][rows], b["seq_lens"][rows], b["scale"], -1)
    b = make_paged_batch([1, 17, 300, 1100], page=16, Hq=9, Hkv=3, D=64, dtype=torch.bfloat16, seed=5)
    together = decode(b)
    for i in range(4): assert torch.equal(decode(b, slice(i, i + 1))[0], together[i]), i
    e = make_paged_batch([140, 300, 90], [140, 1, 33], page=16, Hq=9, Hkv=3, D=64, dtype=torch.bfloat16, seed=6)
    out = emulated_attention.extend_attention(*[e[k] for k in args], e["extend_lens"], e["scale"], -1)
    assert torch.equal(out[140], decode(e, slice(1, 2), e["q"][140:141])[0])   # the decode row of the step
    alone = emulated_attention.extend_attention(e["q"][:140], e["k_cache"], e["v_cache"], e["page_table"], e["table_idx"][:1],
                                                e["seq_lens"][:1], e["extend_lens"][:1], e["scale"], -1)
    assert torch.equal(alone, out[:140])
