"""The model's matmuls on this CPU: bf16 GEMV (`linear_gemv`), our packed tiles (`linear_packed`: AVX512-BF16 dot
products, else the AVX2 body), the same tiles on AMX where the CPU has it (`linear_packed(..., amx=True)`) and oneDNN's prepacked product (where torch's oneDNN runs bf16: AVX-512 or AVX-NE-CONVERT), over the default model's 121 weight shapes per step (30 layers x qkv/o/gate_up/down + LM head),
weights cold (each is read once per pass, 269 MB in all), for several batch sizes. Medians of `--reps` passes.

    .venv/bin/python benchmarks/bench_linear.py
    .venv/bin/python benchmarks/bench_linear.py --rows 1,8,32 --reps 7
"""
import argparse
import statistics
import time

import torch

from minisgl import kernels
from minisgl.linear import onednn_bf16_available


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,3,8,16,32,64,256")
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    ext = kernels.native()
    tiles = ext is not None and hasattr(ext, "linear_packed") and ext.linear_packed_available()
    h, inter, layers, vocab = 576, 1536, 30, 49152
    shapes = [s for _ in range(layers) for s in ((960, h), (h, h), (2 * inter, h), (h, inter))] + [(vocab, h)]
    torch.manual_seed(0)
    ws = [torch.randn(n, k).bfloat16() for n, k in shapes]
    onednn = [torch.ops.mkldnn._reorder_linear_weight(w, 1) for w in ws] if onednn_bf16_available() else None
    packed = [ext.pack_linear_weight(w) for w in ws] if tiles else None
    amx = tiles and ext.linear_amx_available()
    flops = sum(w.numel() * 2 for w in ws)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {sum(w.numel() for w in ws) * 2 / 1e6:.0f} MB "
          f"of bf16 weights per pass; tiles: {ext.linear_packed_isa() if tiles else 'no (no AVX2)'}; AMX: {'yes' if amx else 'no'}; "
          f"oneDNN bf16: {'yes' if onednn else 'no (needs AVX-512 or AVX-NE-CONVERT)'}")

    def med(f):
        f()
        ts = []
        for _ in range(args.reps):
            t = time.perf_counter(); f(); ts.append(time.perf_counter() - t)
        return statistics.median(ts)

    print("| rows | GEMV ms | tiles ms | AMX ms | oneDNN ms | tiles GFLOP/s | AMX GFLOP/s | oneDNN GFLOP/s |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for m in (int(r) for r in args.rows.split(",")):
        xs = {k: torch.randn(m, k).bfloat16() for k in (h, inter)}
        g = med(lambda: [ext.linear_gemv(xs[w.shape[1]], w, None, "") for w in ws]) if m <= 8 else float("nan")
        t = med(lambda: [ext.linear_packed(xs[w.shape[1]], p, w.shape[0]) for w, p in zip(ws, packed)]) if tiles else float("nan")
        a = med(lambda: [ext.linear_packed(xs[w.shape[1]], p, w.shape[0], None, True)
                         for w, p in zip(ws, packed)]) if amx else float("nan")
        o = med(lambda: [torch.ops.mkldnn._linear_pointwise(xs[w.shape[1]], p, None, "none", [], "")
                         for w, p in zip(ws, onednn)]) if onednn else float("nan")
        rate = lambda s: f"{flops * m / s / 1e9:.0f}"
        print(f"| {m} | {g * 1e3:.2f} | {t * 1e3:.2f} | {a * 1e3:.2f} | {o * 1e3:.2f} | {rate(t)} | {rate(a)} | {rate(o)} |",
              flush=True)


if __name__ == "__main__":
    main()
