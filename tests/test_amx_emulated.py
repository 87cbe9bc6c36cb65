"""The AMX kernel of the quantized linears (`qamx`, csrc/cpu/quant.cpp) on a CPU without AMX: quant.cpp compiled with
-DMINISGL_AMX_EMULATE, where the four tile instructions it uses are scalar C++ (csrc/cpu/amx_emulate.h), so that the
kernel's own logic (the bf16 B tile it dequantizes from the interleaved rows, the A tiles it reads from x, the rows
it stores) is checked here as the chapter checks the real one where AMX exists: every format against the product of
x and the dequantized weight rounded to bf16, within bf16's rounding. The rest of the kernel (its dequantization)
uses AVX512-BF16 and VNNI, so the test needs those."""
from pathlib import Path

import pytest
import torch

from minisgl.kernels import native
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
