"""Wide sweep of minisgl's kernels against `scaled_dot_product_attention` over K/V gathered from the paged cache.

The notebook nbs/04_kernels.ipynb shows a representative subset; this file covers page sizes 1/16/64, GQA
ratios 1/3/4, prefix-cached extends, batches mixing very short and long requests, sliding windows,
fp32 / bf16 / fp16, int32 / int64 index tensors and strided inputs, for every backend that runs here:
the C++ CPU kernels, the torch reference, and the Triton kernels in Triton's interpreter."""
import os

os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton: run its kernels on the CPU

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from minisgl import kernels as K

ROOT = Path(__file__).resolve().parents[1]
HAS_EXT = K.native() is not None
needs_ext = pytest.mark.skipif(not HAS_EXT, reason="minisgl._C not built (pip install --no-build-isolation -e .)")
TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


# ----------------------------------------------------------------------------- fixtures
def make_case(seed, lens, exts=None, page=16, Hq=9, Hkv=3, D=64, dtype=torch.float32, idx=torch.int32,
              pt_dtype=torch.int32, strided_q=False):
    """A paged batch: each request's K/V lives on shuffled pages of a shared pool, one page-table row per
    request at a random row (extra rows stay unused), queries for the last `exts[b]` positions."""
    g = torch.Generator().manual_seed(seed)
    B = len(lens)
    pages = [(n + page - 1) // page for n in lens]
    num_pages = sum(pages) + 3  # spare pages: slots no request owns
    k_cache = torch.randn(num_pages * page, Hkv, D, generator=g).to(dtype)
    v_cache = torch.randn(num_pages * page, Hkv, D, generator=g).to(dtype)
    order = torch.randperm(num_pages, generator=g)
    rows = torch.randperm(B + 2, generator=g)[:B]
    max_len = max(lens) + 7
    page_table = torch.full((B + 2, max_len), 10**6, dtype=pt_dtype)  # garbage beyond each seq_len
    start = 0
    for b, n in enumerate(lens):
        mine = order[start:start + pages[b]]
        start += pages[b]
        page_table[rows[b], :n] = (mine[:, None] * page + torch.arange(page)).flatten()[:n].to(pt_dtype)
    n_q = B if exts is None else sum(exts)
    q = torch.randn(n_q, Hq, D, generator=g).to(dtype)
    if strided_q:  # q as a view into a fused qkv projection output
        qkv = torch.randn(n_q, Hq * D + 2 * Hkv * D, generator=g).to(dtype)
        qkv[:, :Hq * D] = q.reshape(n_q, -1)
        q = qkv[:, :Hq * D].view(n_q, Hq, D)
    case = dict(q=q, k_cache=k_cache, v_cache=v_cache, page_table=page_table, table_idx=rows.to(idx),
                seq_lens=torch.tensor(lens, dtype=idx), scale=D ** -0.5)
    if exts is not None:
        case["extend_lens"] = torch.tensor(exts, dtype=idx)
    return case


def sdpa_reference(q, k_cache, v_cache, page_table, table_idx, seq_lens, scale, extend_lens=None,
                   sliding_window=-1):
    "Per request: gather K/V through the page table, build the causal(+window) mask, call SDPA in fp32."
    exts = [1] * len(seq_lens) if extend_lens is None else extend_lens.tolist()
    out, start = torch.empty(q.shape, dtype=torch.float32), 0
    for row, L, e in zip(table_idx.tolist(), seq_lens.tolist(), exts):
        if e == 0:
            continue
        slots = page_table[row, :L].long()
        k, v = k_cache[slots].float().transpose(0, 1), v_cache[slots].float().transpose(0, 1)  # [Hkv, L, D]
        qq = q[start:start + e].float().transpose(0, 1)                                          # [Hq, e, D]
        q_pos = torch.arange(L - e, L)[:, None]
        k_pos = torch.arange(L)[None, :]
        mask = k_pos <= q_pos
        if sliding_window > 0:
            mask &= k_pos > q_pos - sliding_window
        o = F.scaled_dot_product_attention(qq, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
        out[start:start + e] = o.transpose(0, 1)
        start += e
    return out


def assert_matches(got, want, dtype):
    assert got.dtype == dtype and got.shape == want.shape
    torch.testing.assert_close(got.float(), want, atol=TOL[dtype], rtol=TOL[dtype])


def run(fn_name, case, backend, window=-1):
    args = dict(case)
    return getattr(K, fn_name)(**args, sliding_window=window, backend=backend)


# Batches: very short next to long requests, single token, page-boundary lengths.
DECODE_LENS = [[1], [1, 300, 2, 64], [17, 16, 15, 129, 1, 1, 200], [513]]
EXTEND = [  # (seq_lens, extend_lens): prefill, prefix-cached extends, a 1-token extend, an empty one
    ([37], [37]),
    ([1, 150, 40], [1, 150, 40]),
    ([300, 70, 9, 64], [44, 70, 1, 33]),
    ([200, 5, 129], [0, 5, 65]),
]


# ----------------------------------------------------------------------------- CPU kernels
@needs_ext
@pytest.mark.parametrize("page", [1, 16, 64])
@pytest.mark.parametrize("Hq,Hkv", [(4, 4), (9, 3), (8, 2)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_decode_sweep(page, Hq, Hkv, dtype):
    for i, lens in enumerate(DECODE_LENS):
        for window in (-1, 1, 50) if page == 16 else (-1, 50):
            case = make_case(i, lens, page=page, Hq=Hq, Hkv=Hkv, dtype=dtype,
                             idx=torch.int64 if i % 2 else torch.int32)
            want = sdpa_reference(**case, sliding_window=window)
            assert_matches(run("decode_attention", case, "cpu", window), want, dtype)


@needs_ext
@pytest.mark.parametrize("page", [1, 16, 64])
@pytest.mark.parametrize("Hq,Hkv", [(4, 4), (9, 3), (8, 2)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_extend_sweep(page, Hq, Hkv, dtype):
    for i, (lens, exts) in enumerate(EXTEND):
        for window in (-1, 1, 40) if page == 16 else (-1, 40):
            case = make_case(i, lens, exts, page=page, Hq=Hq, Hkv=Hkv, dtype=dtype,
                             pt_dtype=torch.int64 if i % 2 else torch.int32)
            want = sdpa_reference(**case, sliding_window=window)
            assert_matches(run("extend_attention", case, "cpu", window), want, dtype)


@needs_ext
@pytest.mark.parametrize("D", [32, 80, 128, 256])
def test_cpu_head_dims_fp16_and_strided_q(D):
    "Head dims other than the specialised 64/128, fp16, and q as a strided view of a fused qkv buffer."
    for dtype in (torch.float16, torch.float32):
        case = make_case(D, [3, 90, 200], page=16, Hq=6, Hkv=2, D=D, dtype=dtype, strided_q=True)
        assert not case["q"].is_contiguous()
        assert_matches(run("decode_attention", case, "cpu"), sdpa_reference(**case), dtype)
        case = make_case(D, [3, 90, 200], [3, 20, 130], page=16, Hq=6, Hkv=2, D=D, dtype=dtype, strided_q=True)
        assert_matches(run("extend_attention", case, "cpu", 33), sdpa_reference(**case, sliding_window=33), dtype)


BF16_DOT = HAS_EXT and K.native().cpu_isa() == "avx512bf16"


@needs_ext
@pytest.mark.parametrize("D", [64, 80, 128])
@pytest.mark.parametrize("Hq,Hkv", [(8, 1), (6, 2), (5, 5)])
def test_cpu_bf16_bodies_tight(D, Hq, Hkv):
    """bf16 caches: on a CPU with AVX512-BF16 the extend kernel multiplies bf16 pairs (`vdpbf16ps`) and rounds P to
    bf16; the error must stay near bf16's own rounding of the output (8e-3, four times tighter than the sweep's
    bound), at every tile edge (16 / 32 / 64 keys), for head dims that are not a multiple of 64 (80: masked
    tails), GQA groups of 1 to 8, windows, and q as a strided view; decode alike (on a CPU with AMX, head_dim 64
    runs the AMX body, which also rounds P to bf16; other shapes the fp32 bodies)."""
    print("cpu kernels:", K.native().cpu_isa())
    lens = [1, 15, 16, 17, 31, 32, 33, 63, 64, 65, 129, 300]
    for window in (-1, 7, 40):
        case = make_case(D + Hq, lens, page=16, Hq=Hq, Hkv=Hkv, D=D, dtype=torch.bfloat16, strided_q=True)
        torch.testing.assert_close(run("decode_attention", case, "cpu", window).float(),
                                   sdpa_reference(**case, sliding_window=window), atol=8e-3, rtol=8e-3)
        exts = [1, 15, 3, 17, 31, 1, 33, 40, 64, 2, 129, 100]  # prefills and extends over a cached prefix
        case = make_case(D + Hkv, lens, exts, page=16, Hq=Hq, Hkv=Hkv, D=D, dtype=torch.bfloat16, strided_q=True)
        torch.testing.assert_close(run("extend_attention", case, "cpu", window).float(),
                                   sdpa_reference(**case, sliding_window=window), atol=8e-3, rtol=8e-3)


@needs_ext
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_decode_every_group_size(dtype):
    """GQA groups of 1 to 8 query heads at head dims 64 and 128, at the edges of a 32-key tile and of the 4-key steps
    inside it: the AVX2 body takes a KV head's query heads three at a time (then two or one) and its keys four at a
    time, reading the rows from their pages; on a CPU whose default body is another, that body runs these cases."""
    for D in (64, 128):
        for G in range(1, 9):
            case = make_case(G + D, [1, 3, 4, 5, 31, 32, 33, 70, 300], page=16, Hq=2 * G, Hkv=2, D=D, dtype=dtype,
                             strided_q=G % 2 == 0)
            assert_matches(run("decode_attention", case, "cpu"), sdpa_reference(**case), dtype)
            assert_matches(run("decode_attention", case, "cpu", 30), sdpa_reference(**case, sliding_window=30), dtype)


@needs_ext
def test_cpu_decode_long_single_request_splits_keys():
    "One long request in a small batch is split into key chunks across threads; the merge must be exact."
    for dtype in (torch.float32, torch.bfloat16):   # bf16, head_dim 64: the AMX body where the CPU has it
        case = make_case(7, [4000], page=64, Hq=9, Hkv=3, dtype=dtype)
        assert_matches(run("decode_attention", case, "cpu"), sdpa_reference(**case), dtype)
        assert_matches(run("decode_attention", case, "cpu", 1000), sdpa_reference(**case, sliding_window=1000), dtype)


@needs_ext
def test_cpu_decode_equals_extend_of_one_token():
    case = make_case(3, [1, 77, 300], page=16)
    dec = run("decode_attention", case, "cpu")
    ext = K.extend_attention(**case, extend_lens=torch.ones(3, dtype=torch.int32), backend="cpu")
    torch.testing.assert_close(dec, ext, atol=1e-6, rtol=1e-6)


@needs_ext
def test_cpu_batch_independence():
    "A request's output does not depend on the other requests in its batch."
    case = make_case(5, [120, 7, 260], [60, 7, 100], page=16)
    full = run("extend_attention", case, "cpu")
    alone = dict(case, q=case["q"][67:], table_idx=case["table_idx"][2:], seq_lens=case["seq_lens"][2:],
                 extend_lens=case["extend_lens"][2:])
    torch.testing.assert_close(full[67:], run("extend_attention", alone, "cpu"), atol=0, rtol=0)


def _variant_check():
    "Run in a subprocess with MINISGL_CPU_ISA set: a few decode/extend cases on the narrower ISA variant."
    for D, dtype in ((64, torch.float32), (128, torch.bfloat16), (80, torch.float32)):
        for window in (-1, 21):
            case = make_case(D, [1, 70, 33, 250], page=16, Hq=9, Hkv=3, D=D, dtype=dtype)
            assert_matches(run("decode_attention", case, "cpu", window), sdpa_reference(**case, sliding_window=window),
                           dtype)
            case = make_case(D, *EXTEND[2], page=16, Hq=8, Hkv=2, D=D, dtype=dtype)
            assert_matches(run("extend_attention", case, "cpu", window), sdpa_reference(**case, sliding_window=window),
                           dtype)
    for G in (1, 2, 4, 5):   # groups the AVX2 body splits into three heads and two or one
        case = make_case(G, [5, 33, 300], page=16, Hq=2 * G, Hkv=2, D=64, dtype=torch.bfloat16)
        assert_matches(run("decode_attention", case, "cpu"), sdpa_reference(**case), torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    for n in (5, 8, 17, 49152):   # greedy sampling's argmax: ties, NaN, all -inf, and every tail of the lanes
        x = torch.randn(4, n, generator=g)
        x[0, [1, n - 1]] = 50.0
        x[1, n // 2] = float("nan")
        x[2] = -float("inf")
        assert torch.equal(K.native().argmax_rows(x), x.max(-1).indices), n
    print(f"isa={K.native().cpu_isa()}")


@needs_ext
@pytest.mark.parametrize("isa", ["avx512", "avx2", "baseline"])
def test_cpu_narrower_isa_variants(isa):
    """The kernels are compiled for AVX512-BF16 (bf16 caches only), AVX-512, AVX2 and baseline x86-64; check the
    variants this CPU would skip (avx512: the fp32 bodies over bf16 caches, what a CPU without AVX512-BF16 runs)."""
    order = ["baseline", "avx2", "avx512", "avx512bf16"]
    if order.index(K.native().cpu_isa()) <= order.index(isa):
        pytest.skip(f"this CPU's kernels are {K.native().cpu_isa()}: the {isa} variant is what the other tests run")
    code = "import sys; sys.path.insert(0, 'tests'); import test_kernels; test_kernels._variant_check()"
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env={**os.environ, "MINISGL_CPU_ISA": isa},
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    assert f"isa={isa}" in proc.stdout


# ----------------------------------------------------------------------------- store_kv
@pytest.mark.parametrize("backend", ["cpu", "torch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("idx", [torch.int32, torch.int64])
def test_store_kv(backend, dtype, idx):
    if backend == "cpu" and not HAS_EXT:
        pytest.skip("minisgl._C not built")
    g = torch.Generator().manual_seed(0)
    N, Hkv, D, slots = 37, 3, 64, 200
    k_cache = torch.zeros(slots, Hkv, D, dtype=dtype)
    v_cache = torch.zeros(slots, Hkv, D, dtype=dtype)
    out_loc = torch.randperm(slots, generator=g)[:N].to(idx)
    qkv = torch.randn(N, (9 + 2 * Hkv) * D, generator=g).to(dtype)  # k, v: strided views of a fused buffer
    k = qkv[:, 9 * D:(9 + Hkv) * D].view(N, Hkv, D)
    v = qkv[:, (9 + Hkv) * D:].view(N, Hkv, D)
    assert not k.is_contiguous()
    K.store_kv(k_cache, v_cache, out_loc, k, v, backend=backend)
    want_k = torch.zeros_like(k_cache)
    want_k[out_loc.long()] = k
    want_v = torch.zeros_like(v_cache)
    want_v[out_loc.long()] = v
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)
    # a transposed (head-major) k is accepted too
    kt = k.transpose(0, 1).contiguous().transpose(0, 1)
    K.store_kv(k_cache, v_cache, out_loc[:5], kt[:5] * 2, v[:5], backend=backend)
    assert torch.equal(k_cache[out_loc[:5].long()], (k[:5] * 2).to(dtype))


@needs_ext
def test_store_kv_casts_and_checks_slots():
    k_cache = torch.zeros(10, 1, 4, dtype=torch.bfloat16)
    v_cache = torch.zeros_like(k_cache)
    k = torch.randn(2, 1, 4)  # fp32 rows into a bf16 cache
    K.store_kv(k_cache, v_cache, torch.tensor([3, 9]), k, k, backend="cpu")
    assert torch.equal(k_cache[[3, 9]], k.bfloat16())
    with pytest.raises(RuntimeError, match="out_loc"):
        K.store_kv(k_cache, v_cache, torch.tensor([3, 10]), k, k, backend="cpu")


# ----------------------------------------------------------------------------- torch reference
@pytest.mark.parametrize("page,Hq,Hkv", [(1, 4, 4), (16, 9, 3), (64, 8, 2)])
def test_torch_reference_matches_sdpa(page, Hq, Hkv):
    for window in (-1, 30):
        case = make_case(page, [1, 150, 40, 9], page=page, Hq=Hq, Hkv=Hkv, dtype=torch.bfloat16)
        assert_matches(run("decode_attention", case, "torch", window), sdpa_reference(**case, sliding_window=window),
                       torch.bfloat16)
        case = make_case(page, *EXTEND[2], page=page, Hq=Hq, Hkv=Hkv)
        assert_matches(run("extend_attention", case, "torch", window), sdpa_reference(**case, sliding_window=window),
                       torch.float32)


# ----------------------------------------------------------------------------- triton (interpreter)
triton = pytest.importorskip("triton", reason="triton not installed")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_triton_decode_interpreted(dtype):
    from minisgl.triton_attention import decode_attention_triton
    for window in (-1, 9):
        case = make_case(1, [1, 45, 16, 3], page=4, Hq=6, Hkv=2, D=16, dtype=dtype,
                         idx=torch.int64, pt_dtype=torch.int64)
        got = decode_attention_triton(**case, sliding_window=window, num_splits=4)
        assert_matches(got, sdpa_reference(**case, sliding_window=window), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_triton_extend_interpreted(dtype):
    from minisgl.triton_attention import extend_attention_triton
    for window in (-1, 9):
        case = make_case(2, [40, 3, 21], [17, 3, 0], page=4, Hq=4, Hkv=1, D=16, dtype=dtype, strided_q=True)
        got = extend_attention_triton(**case, sliding_window=window, block_m=16, block_n=16)
        assert_matches(got, sdpa_reference(**case, sliding_window=window), dtype)


# ----------------------------------------------------------------------------- the Python face
def test_available_backends_and_dispatch():
    names = K.available_backends()
    assert names[-1] == "torch" and set(names) <= {"cpu", "cuda", "triton", "torch"}
    assert ("cpu" in names) == HAS_EXT
    with pytest.raises(ValueError, match="backend"):
        K._resolve("tpu", torch.device("cpu"))
    with pytest.raises(ValueError, match="CUDA tensors"):
        K._resolve("triton", torch.device("cpu"))


def test_missing_extension_says_how_to_build(monkeypatch):
    monkeypatch.setattr(K, "native", lambda: None)
    case = make_case(0, [5])
    with pytest.raises(RuntimeError, match=r"pip install --no-build-isolation -e \."):
        run("decode_attention", case, "cpu")
    monkeypatch.setattr(K, "_warned_fallback", False)
    with pytest.warns(UserWarning, match="pip install --no-build-isolation -e"):
        out = run("decode_attention", case, None)  # automatic choice: falls back to the reference, loudly
    assert_matches(out, sdpa_reference(**case), torch.float32)


@pytest.mark.parametrize("field,bad,match", [
    ("q", torch.zeros(2, 9, 32), "head_dim"),
    ("q", torch.zeros(2, 8, 64), "multiple of kv heads"),
    ("seq_lens", torch.tensor([1.0, 2.0]), "seq_lens"),
    ("table_idx", torch.tensor([0, 1, 2], dtype=torch.int32), "seq_lens has 2 entries"),
    ("page_table", torch.zeros(4, dtype=torch.int32), "page_table"),
    ("scale", 0.0, "scale"),
])
def test_python_checks_name_the_field(field, bad, match):
    case = make_case(0, [3, 4])
    case[field] = bad
    with pytest.raises(ValueError, match=match):
        run("decode_attention", case, None)


@needs_ext
def test_native_checks_name_the_argument():
    "The extension validates its own inputs (it may be called directly), naming the argument."
    case = make_case(0, [3, 4], [3, 2])
    C = K.native()
    args = lambda **kw: {**{k: case[k] for k in ("q", "k_cache", "v_cache", "page_table", "table_idx",
                                                  "seq_lens", "extend_lens", "scale")}, **kw}
    with pytest.raises(RuntimeError, match="extend_lens"):
        C.extend_attention(**args(extend_lens=torch.tensor([3, 3], dtype=torch.int32)))
    with pytest.raises(RuntimeError, match="table_idx"):
        C.extend_attention(**args(table_idx=torch.tensor([0, 99], dtype=torch.int32)))
    with pytest.raises(RuntimeError, match="v_cache"):
        C.extend_attention(**args(v_cache=case["v_cache"][:5]))
    with pytest.raises(RuntimeError, match="seq_lens"):
        C.extend_attention(**args(seq_lens=torch.tensor([3, 10**6], dtype=torch.int32)))


# ----------------------------------------------------------------------------- CUDA sources
def test_cuda_sources_compile():
    "Every csrc/cuda/*.cu compiles with nvcc against torch's headers, even where torch has no CUDA."
    if shutil.which("nvcc") is None and not Path("/usr/local/cuda/bin/nvcc").exists():
        pytest.skip("nvcc not installed")
    proc = subprocess.run(["bash", str(ROOT / "scripts/check_cuda_compile.sh")], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    assert proc.stdout.count("ok ") == len(list((ROOT / "csrc/cuda").glob("*.cu")))


@needs_ext
def test_engine_serves_with_the_reference_attention_where_the_native_one_is_wrong(tmp_path, monkeypatch, caplog):
    """The engine checks every C++ attention body for its model's heads and KV dtype as it starts (`attention_problem`):
    the real kernels pass here (with and without a sliding window); extend attention made wrong in one head's outputs is
    caught: wrong in every body, the engine serves with the torch reference's attention, with a warning (in fp32: the same
    tokens); wrong in the flags' body only, it keeps another body and says which was wrong."""
    import logging
    from dataclasses import replace
    from tokenizers import Tokenizer, models
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
    import minisgl.engine as E
    from minisgl.core import SamplingParams
    from minisgl.messages import UserMsg
    from minisgl.scheduler import Scheduler, SchedulerConfig
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)).save_pretrained(tmp_path)
    PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"<unk>": 0}, unk_token="<unk>"))).save_pretrained(tmp_path)

    def tokens(dtype):
        eng = E.Engine(E.EngineConfig(model=str(tmp_path), dtype=dtype, device="cpu", num_pages=64, page_size=4), progress=False)
        s = Scheduler(eng, SchedulerConfig(max_running_reqs=4))
        for uid, p in enumerate([[5, 6, 7], list(range(10, 40)), [42]]):
            s.submit(UserMsg(uid, p, SamplingParams(max_tokens=8, ignore_eos=True)))
        return eng.backend, {uid: [o.token_id for o in outs] for uid, outs in s.run_until_idle().items()}

    cfg = E.ModelConfig.from_hf(E.load_hf_config(tmp_path))
    for dtype in (torch.float32, torch.bfloat16):
        for c in (cfg, replace(cfg, sliding_windows=[8, -1])):
            assert E.attention_problem(c, dtype, "cpu") is None
    right = {dtype: tokens(dtype) for dtype in ("float32", "bfloat16")}
    assert all(backend is None for backend, _ in right.values())
    real, group = E.extend_attention, cfg.num_heads // cfg.num_kv_heads
    def one_head_wrong(*a, **k):   # in `wrong_bodies` (all: None) of this model's extend case
        out = real(*a, **k)
        if k.get("backend") == "cpu" and (wrong_bodies is None or E.attention_body("extend", out.dtype, cfg.head_dim, group) in wrong_bodies):
            out[:, 1] += 0.25
        return out
    monkeypatch.setattr(E, "extend_attention", one_head_wrong)
    wrong_bodies = None
    assert E.attention_problem(cfg, torch.float32, "cpu").startswith("extend attention: ")
    for dtype in ("float32", "bfloat16"):
        with caplog.at_level(logging.WARNING, logger="minisgl.engine"):
            backend, got = tokens(dtype)
        assert backend == "torch" and "the C++ attention computes wrong on this CPU (extend attention: " in caplog.text
        assert got == right[dtype][1] if dtype == "float32" else len(got[1]) == 8   # bf16: the reference rounds otherwise,
        caplog.clear()                                                              # and a random model is all near ties
    # only the body the flags pick is wrong: the engine keeps another that answers right, and serves natively
    for dtype in (torch.float32, torch.bfloat16):
        bodies = E.attention_bodies("extend", dtype, cfg.head_dim, group)
        wrong_bodies = bodies[:1]
        with caplog.at_level(logging.WARNING, logger="minisgl.engine"):
            backend, got = tokens(str(dtype)[6:])
        if len(bodies) == 1:   # a CPU with one body (no AVX2): nothing else to keep
            assert backend == "torch"; continue
        assert backend is None and f"the C++ extend attention's {bodies[0]} bodies compute wrong on this CPU" in caplog.text
        assert E.attention_body("extend", dtype, cfg.head_dim, group) in bodies[1:]
        assert got == right[str(dtype)[6:]][1] if dtype == torch.float32 else len(got[1]) == 8
        caplog.clear()
