"""Micro-benchmark of minisgl's attention kernels on the 135M model's shapes (SmolLM2-135M: 9 query heads,
3 KV heads, head_dim 64, 30 layers), one layer per call.

    .venv/bin/python benchmarks/bench_kernels.py [--dtype bf16] [--reps 20]

Compares the C++ CPU kernels (`backend='cpu'`) with the readable torch reference (`backend='torch'`) and
with `scaled_dot_product_attention` over K/V gathered from the page table into a padded batch (what a
pure-torch engine would do). Reports the median time per call. Then, for bf16 (or `--step-only`):
  - the attention of a whole 48-request decode step: 30 layers, each over its own cache (so that the L3 does
    not hold them all, as in the engine), each request's slots contiguous as the allocator gives them;
  - the bf16 RMS norms (`rms_norm`, `fused_add_rms_norm_`) of a 2048-token prefill round and of 48 rows.

    .venv/bin/python benchmarks/bench_kernels.py --dtype bf16 --step-only"""
import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from minisgl.kernels import native, decode_attention, extend_attention

HQ, HKV, D, PAGE = 9, 3, 64, 16


def median_ms(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def make_batch(lens: list[int], dtype: torch.dtype):
    "A paged cache holding each request's K/V on shuffled pages, and its page table."
    g = torch.Generator().manual_seed(0)
    pages = [(n + PAGE - 1) // PAGE for n in lens]
    num_pages = sum(pages)
    k_cache = torch.randn(num_pages * PAGE, HKV, D, generator=g).to(dtype)
    v_cache = torch.randn(num_pages * PAGE, HKV, D, generator=g).to(dtype)
    order = torch.randperm(num_pages, generator=g)
    page_table = torch.zeros(len(lens), max(lens), dtype=torch.int32)
    start = 0
    for b, n in enumerate(lens):
        mine = order[start:start + pages[b]]
        start += pages[b]
        page_table[b, :n] = (mine[:, None] * PAGE + torch.arange(PAGE)).flatten()[:n].int()
    table_idx = torch.arange(len(lens), dtype=torch.int32)
    return k_cache, v_cache, page_table, table_idx, torch.tensor(lens, dtype=torch.int32)


def sdpa_paged(q, k_cache, v_cache, page_table, lens, q_lens):
    "SDPA over a padded batch gathered through the page table; q: [B, Tq, Hq, D] (right-aligned queries)."
    B, Lmax = page_table.shape
    k = k_cache[page_table.long()].transpose(1, 2)  # [B, Hkv, Lmax, D]
    v = v_cache[page_table.long()].transpose(1, 2)
    tq = q.shape[1]
    qpos = lens[:, None] - q_lens[:, None] + torch.arange(tq)[None]           # [B, Tq]
    kpos = torch.arange(Lmax)
    mask = (kpos[None, None, :] <= qpos[:, :, None]) & (kpos[None, None, :] < lens[:, None, None])
    return F.scaled_dot_product_attention(q.transpose(1, 2), k, v, attn_mask=mask[:, None], enable_gqa=True)


def decode_step_attention(dtype, reps: int, B: int = 48, L: int = 260, layers: int = 30) -> float:
    "ms of the decode attention of one step: `layers` calls, each over a cache of its own, slots contiguous per request."
    g = torch.Generator().manual_seed(0)
    caches = [(torch.randn(B * L, HKV, D, generator=g).to(dtype), torch.randn(B * L, HKV, D, generator=g).to(dtype))
              for _ in range(layers)]
    table = torch.arange(B * L, dtype=torch.int32).view(B, L).contiguous()
    idx, sl = torch.arange(B, dtype=torch.int32), torch.full((B,), L, dtype=torch.int32)
    q = torch.randn(B, HQ, D, generator=g).to(dtype)
    return median_ms(lambda: [decode_attention(q, k, v, table, idx, sl, D ** -0.5, backend="cpu") for k, v in caches], reps)


def norms(reps: int):
    "ms of the bf16 norms at a prefill round's 2048 rows and a decode step's 48 (hidden size 576)."
    ext, w = native(), torch.randn(576).bfloat16()
    for rows in (2048, 48):
        x, r = torch.randn(rows, 576).bfloat16(), torch.randn(rows, 576).bfloat16()
        a = median_ms(lambda: ext.rms_norm(x, w, 1e-5), reps)
        b = median_ms(lambda: ext.fused_add_rms_norm_(x, r, w, 1e-5), reps)
        print(f"{f'bf16 norms, {rows} x 576':34s} rms_norm {a * 1e3:8.1f} us, fused_add_rms_norm_ {b * 1e3:8.1f} us")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--step-only", action="store_true", help="only the decode step's attention and the norms (bf16)")
    args = ap.parse_args()
    dtype = torch.float32 if args.dtype == "fp32" else torch.bfloat16
    scale = D ** -0.5
    print(f"threads={torch.get_num_threads()} isa={native().cpu_isa()} dtype={args.dtype} Hq={HQ} Hkv={HKV} D={D} "
          f"page={PAGE}")
    if args.step_only or dtype == torch.bfloat16:
        ms = decode_step_attention(torch.bfloat16, args.reps)
        print(f"{'decode step, 48 x 260, 30 layers':34s} {ms:9.3f} ms (bf16 caches)")
        norms(args.reps * 5)
        if args.step_only: return
    print(f"{'case':34s} {'cpu ms':>9s} {'torch ms':>9s} {'sdpa ms':>9s}")
    for B, L in [(1, 512), (32, 256), (64, 256), (64, 512)]:
        lens = [L] * B
        kc, vc, pt, ti, sl = make_batch(lens, dtype)
        q = torch.randn(B, HQ, D).to(dtype)
        cpu = median_ms(lambda: decode_attention(q, kc, vc, pt, ti, sl, scale, backend="cpu"), args.reps)
        ref = median_ms(lambda: decode_attention(q, kc, vc, pt, ti, sl, scale, backend="torch"), max(3, args.reps // 4))
        sdp = median_ms(lambda: sdpa_paged(q[:, None], kc, vc, pt, sl, torch.ones(B, dtype=torch.int32)), args.reps)
        print(f"{f'decode B={B} L={L}':34s} {cpu:9.3f} {ref:9.3f} {sdp:9.3f}")
    for B, L, prefix in [(1, 256, 0), (1, 512, 0), (4, 300, 0), (2, 512, 256)]:
        lens = [L] * B
        ext = [L - prefix] * B
        kc, vc, pt, ti, sl = make_batch(lens, dtype)
        el = torch.tensor(ext, dtype=torch.int32)
        q = torch.randn(sum(ext), HQ, D).to(dtype)
        cpu = median_ms(lambda: extend_attention(q, kc, vc, pt, ti, sl, el, scale, backend="cpu"), args.reps)
        ref = median_ms(lambda: extend_attention(q, kc, vc, pt, ti, sl, el, scale, backend="torch"), max(3, args.reps // 4))
        sdp = median_ms(lambda: sdpa_paged(q.view(B, -1, HQ, D), kc, vc, pt, sl, el), args.reps)
        print(f"{f'extend B={B} L={L} prefix={prefix}':34s} {cpu:9.3f} {ref:9.3f} {sdp:9.3f}")


if __name__ == "__main__":
    main()
