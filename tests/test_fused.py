"""The fused element-wise ops of `minisgl._C` (csrc/cpu/fused.cpp) against their torch references, and the
model's fused decode path against its plain torch path.

Each op rounds at the same points as the torch code in `minisgl.models`, so bf16 results match to one bf16 ulp
(RMSNorm sums in another order); fp32 results match to float rounding."""
import pytest
import torch
import torch.nn.functional as F

from minisgl import kernels
from minisgl.models import CausalLM, ForwardContext, ModelConfig, RMSNorm, RotaryEmbedding

EXT = kernels.native()
needs_ext = pytest.mark.skipif(EXT is None or not hasattr(EXT, "rope_store_kv_"),
                               reason="minisgl._C not built (pip install --no-build-isolation -e .)")
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def close(a, b, dtype):
    tol = {torch.float32: 1e-5, torch.bfloat16: 1.6e-2, torch.float16: 2e-3}[dtype]
    torch.testing.assert_close(a.float(), b.float(), atol=tol, rtol=tol)


def norm_ref(x, w, eps):
    if x.dtype == torch.float32: return F.rms_norm(x, (x.shape[-1],), w, eps)
    return F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype) * w


@needs_ext
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 3, 40])   # 40 > one task: split over threads
def test_rms_norm(dtype, rows):
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 67, generator=g).to(dtype)
    w = (1 + torch.randn(67, generator=g)).to(dtype)
    close(EXT.rms_norm(x, w, 1e-6), norm_ref(x, w, 1e-6), dtype)
    big = torch.randn(rows, 2 * 67, generator=g).to(dtype)[:, ::2]   # strided rows: not contiguous in dim 1
    with pytest.raises(RuntimeError, match="contiguous"): EXT.rms_norm(big, w, 1e-6)


@needs_ext
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 3, 40])
def test_fused_add_rms_norm(dtype, rows):
    g = torch.Generator().manual_seed(rows)
    x, r = torch.randn(rows, 576, generator=g).to(dtype), torch.randn(rows, 576, generator=g).to(dtype)
    w = (1 + torch.randn(576, generator=g)).to(dtype)
    want_r = x + r
    want = norm_ref(want_r, w, 1e-5)
    EXT.fused_add_rms_norm_(x, r, w, 1e-5)
    torch.testing.assert_close(r, want_r, atol=0, rtol=0)   # the add rounds once, like torch
    close(x, want, dtype)
    # the module's fused path is the same op
    norm = RMSNorm(576, 1e-5).to(dtype)
    with torch.no_grad(): norm.weight.copy_(w)
    x2, r2 = torch.randn(rows, 576, generator=g).to(dtype), torch.randn(rows, 576, generator=g).to(dtype)
    y_ref, r_ref = norm(x2, r2)
    y, r_out = norm(x2.clone(), r2.clone(), fused=True)
    close(y, y_ref, dtype); torch.testing.assert_close(r_out, r_ref, atol=0, rtol=0)


@needs_ext
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 40])
def test_silu_mul(dtype, rows):
    g = torch.Generator().manual_seed(rows)
    gu = (3 * torch.randn(rows, 2 * 1536, generator=g)).to(dtype)
    gate, up = gu.clone().split(1536, -1)
    want = F.silu(gate, inplace=True).mul_(up)
    close(EXT.silu_mul(gu), want, dtype)
    with pytest.raises(RuntimeError, match="even"): EXT.silu_mul(gu[:, :-1].contiguous())


@needs_ext
def test_fused_kernels_use_the_widest_vectors():
    """The fused kernels follow the attention kernels' ISA choice: on an AVX-512 machine (with or without AVX512-BF16)
    the SiLU row is the AVX-512 one (a name check let AVX512-BF16 machines fall to the scalar row once: 25% of a
    workload's throughput)."""
    isa = EXT.cpu_isa()
    want = "avx512" if isa.startswith("avx512") else isa
    assert EXT.silu_isa() == want, (isa, EXT.silu_isa())


@needs_ext
@pytest.mark.parametrize("scale", [1, 30, 100])
def test_silu_mul_bf16_bits(scale):
    "The vectorised bf16 path (its own exp) gives torch's bits, out to where exp(-x) overflows, and at inf / NaN."
    g = torch.Generator().manual_seed(scale)
    gu = (scale * torch.randn(16, 2 * 1536, generator=g)).bfloat16()
    gu[0, :5] = torch.tensor([float('nan'), float('inf'), -float('inf'), 0., -88.5])
    gate, up = gu.clone().split(1536, -1)
    want, got = F.silu(gate, inplace=True).mul_(up), EXT.silu_mul(gu)
    assert ((got == want) | (got.isnan() & want.isnan())).all()


@needs_ext
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1, 3, 37])
def test_rope_store_kv(dtype, n):
    hq, hkv, d, slots = 9, 3, 64, 100
    g = torch.Generator().manual_seed(n)
    rot = RotaryEmbedding(d, {'rope_type': 'default', 'rope_theta': 10000.0}, 128, dtype=dtype)
    qkv = torch.randn(n, (hq + 2 * hkv) * d, generator=g).to(dtype)
    pos = torch.randint(0, 128, (n,), generator=g)
    loc = torch.randperm(slots, generator=g)[:n]
    kc, vc = torch.zeros(slots, hkv, d, dtype=dtype), torch.zeros(slots, hkv, d, dtype=dtype)
    # reference: the model's torch path
    qk = rot.apply(qkv[:, :(hq + hkv) * d].view(n, hq + hkv, d), *rot.lookup(pos))
    v = qkv[:, (hq + hkv) * d:].view(n, hkv, d)
    EXT.rope_store_kv_(qkv, pos, rot.cos, rot.sin, kc, vc, loc.int(), hq, hkv)
    close(qkv[:, :(hq + hkv) * d].view(n, hq + hkv, d), qk, dtype)
    close(kc[loc], qk[:, hq:], dtype)
    torch.testing.assert_close(vc[loc], v, atol=0, rtol=0)
    untouched = torch.ones(slots, dtype=torch.bool); untouched[loc] = False
    assert (kc[untouched] == 0).all() and (vc[untouched] == 0).all()
    with pytest.raises(RuntimeError, match="out_loc"):
        EXT.rope_store_kv_(qkv, pos, rot.cos, rot.sin, kc, vc, torch.full((n,), slots), hq, hkv)
    with pytest.raises(RuntimeError, match="position"):
        EXT.rope_store_kv_(qkv, torch.full((n,), 128), rot.cos, rot.sin, kc, vc, loc, hq, hkv)
    with pytest.raises(RuntimeError, match="qkv"):
        EXT.rope_store_kv_(qkv[:, :-d].contiguous(), pos, rot.cos, rot.sin, kc, vc, loc, hq, hkv)


def _tiny(model_type, dtype):
    cfg = ModelConfig.from_hf({'model_type': model_type, 'vocab_size': 64, 'hidden_size': 64, 'intermediate_size': 96,
                               'num_hidden_layers': 3, 'num_attention_heads': 4, 'num_key_value_heads': 2,
                               'head_dim': 16, 'max_position_embeddings': 64, 'tie_word_embeddings': True})
    torch.manual_seed(0)
    m = CausalLM(cfg).eval()
    with torch.no_grad():
        for p in m.parameters(): p.normal_(0, 0.3)
        for name, p in m.named_parameters():
            if 'norm' in name: p.add_(1)
    return m.to(dtype)


@needs_ext
@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_model_fused_matches_torch(model_type, dtype):
    "Prefill two requests then decode two steps: fused (and, for bf16 decode, `_decode_layers`) vs plain torch."
    m = _tiny(model_type, dtype)
    page_table = torch.zeros(2, 32, dtype=torch.int32)
    page_table[0] = torch.arange(0, 32); page_table[1] = torch.arange(32, 64)
    runs = {}
    for fused in (False, True):
        kv = [(torch.zeros(64, 2, 16, dtype=dtype), torch.zeros(64, 2, 16, dtype=dtype)) for _ in range(3)]
        def step(ids, pos, seq_lens, ext, prefill):
            out_loc = torch.cat([page_table[r, s - e:s] for r, (s, e) in enumerate(zip(seq_lens, ext))]).long()
            ctx = ForwardContext(prefill, out_loc, page_table, torch.tensor([0, 1], dtype=torch.int32),
                                 torch.tensor(seq_lens, dtype=torch.int32), torch.tensor(ext, dtype=torch.int32), kv,
                                 backend=None if fused else 'torch', fused=fused)
            last = torch.tensor(ext).cumsum(0) - 1
            with torch.inference_mode(): return m(torch.tensor(ids), torch.tensor(pos), ctx, last if prefill else None)
        outs = [step([1, 2, 3, 4, 5, 7, 8, 9], [0, 1, 2, 3, 4, 0, 1, 2], [5, 3], [5, 3], True),
                step([10, 11], [5, 3], [6, 4], [1, 1], False),
                step([12, 13], [6, 4], [7, 5], [1, 1], False)]
        runs[fused] = outs
    for a, b in zip(runs[False], runs[True]):
        # bf16: the fused path rounds where torch does, except the AVX512-BF16 prefill attention, which rounds P to
        # bf16 (held to bf16's rounding in test_kernels.py); this random model (weights of std 0.3) magnifies a
        # single-ulp flip of its activations into logit changes up to ~0.25
        tol = 1e-4 if dtype == torch.float32 else 0.3
        torch.testing.assert_close(b, a, atol=tol, rtol=tol)
        assert (a.argmax(-1) == b.argmax(-1)).all() or dtype != torch.float32


@needs_ext
def test_decode_layers_used_for_bf16_decode():
    m = _tiny("llama", torch.bfloat16)
    x = torch.zeros(1, 64, dtype=torch.bfloat16)
    ctx = ForwardContext(False, None, None, None, None, None, [], fused=True)
    assert m._direct_decode(x, ctx) == hasattr(EXT, "linear_gemv")
    assert not m._direct_decode(torch.zeros(8, 64, dtype=torch.bfloat16), ctx)   # too many rows for the GEMV
    assert not m._direct_decode(x.float(), ctx)


@needs_ext
@pytest.mark.parametrize("shape", [(1, 1), (3, 15), (5, 17), (48, 49152), (7, 1000)])
def test_argmax_rows_is_torch_max_indices(shape):
    "The first maximum of every row, the first NaN where a row has one, at every tail of the 16 lanes."
    g = torch.Generator().manual_seed(shape[1])
    x = torch.randn(*shape, generator=g)
    if shape[1] >= 8:
        x[0, [1, shape[1] - 1]] = 50.0                           # a tie: the first index wins
        x[-1] = -float("inf")                                   # all -inf: index 0
    if shape[0] >= 3 and shape[1] >= 8:
        x[1, [shape[1] // 2, 2]] = float("nan")                 # the first NaN wins over everything
        x[2, shape[1] - 1] = float("inf")
    assert torch.equal(EXT.argmax_rows(x), x.max(-1).indices)
    if shape[1] > 2:
        assert torch.equal(EXT.argmax_rows(x[:, 1:]), x[:, 1:].max(-1).indices)   # rows not 64-byte aligned


@needs_ext
def test_argmax_rows_rejects_bad_input():
    with pytest.raises(RuntimeError, match="float32"): EXT.argmax_rows(torch.zeros(2, 3, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="2-D"): EXT.argmax_rows(torch.zeros(3))
    with pytest.raises(RuntimeError, match="1 to"): EXT.argmax_rows(torch.zeros(2, 0))
