"""Perplexity of the embedded Q4_1 GGUF on a fixed text: minisgl served natively (`--quantization gguf`), dequantized
(`none`, fp32), int8 weights, and llama.cpp's `llama-perplexity` on the same file and text, in one run.

The native model runs every linear on `q8dot` (the kernel that rounds the activations, as decode does); the plan's
other kernels compute the dequantized model's products, whose perplexity the `none` line gives.

The text is this repository's README.md (fixed by its commit). It is cut into chunks of `--ctx` tokens (no BOS: the
tokenizer of SmolLM2 adds none); each chunk is scored on its second half given its first, as llama-perplexity does,
and the perplexity is exp(mean negative log-likelihood) over every scored token.

    .venv/bin/python benchmarks/bench_perplexity.py --llama-perplexity /path/to/llama-perplexity

`--model FILE.gguf` scores another file (a Q4_K_M one, say) the same way; `--text FILE` another text.
"""
import argparse
import math
import re
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent


def chunk_nll(engine, ids: list[int]) -> tuple[float, int]:
    "Sum of -log p over the second half of `ids` given the tokens before, one prefill through the engine's model."
    from minisgl.models import ForwardContext
    n = len(ids)
    slots = torch.arange(n)
    ctx = ForwardContext(True, slots, slots.view(1, -1), torch.tensor([0]), torch.tensor([n]), torch.tensor([n]),
                         engine.kv_caches, engine.backend)
    with torch.inference_mode():
        logits = engine.model(torch.tensor(ids), torch.arange(n), ctx, torch.arange(n - 1))
    logp = torch.log_softmax(logits.float(), -1)
    first = n // 2
    tgt = torch.tensor(ids[first:])
    return -logp[first - 1:].gather(1, tgt.view(-1, 1)).sum().item(), len(tgt)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--modes", default="gguf,none,int8")
    ap.add_argument("--llama-perplexity", default=None, metavar="PATH")
    ap.add_argument("--model", default=None, metavar="FILE.gguf", help="a .gguf file (default: the embedded Q4_1 one)")
    ap.add_argument("--text", default=None, metavar="FILE", help="the text to score (default: this repository's README.md)")
    args = ap.parse_args()
    from minisgl.engine import Engine, EngineConfig
    from minisgl.weights import default_gguf_path
    text_file = Path(args.text) if args.text else ROOT / "README.md"
    gguf = args.model or str(default_gguf_path())
    text = text_file.read_text()
    pages = -(-args.ctx // 16) + 1
    for mode in args.modes.split(","):
        e = Engine(EngineConfig(model=gguf, quantization=mode, dtype="float32", num_pages=pages, max_seq_len=args.ctx), progress=False)
        from minisgl.quant import QuantLinear
        for lin in e.model.modules():
            if isinstance(lin, QuantLinear): lin.set_plan([(1 << 20, "q8dot")])
        ids = e.tokenizer(text)["input_ids"]
        chunks = [ids[i:i + args.ctx] for i in range(0, len(ids) - args.ctx + 1, args.ctx)]
        nll = cnt = 0
        for c in chunks:
            s, k = chunk_nll(e, c); nll += s; cnt += k
        print(f"minisgl --quantization {mode}: perplexity {math.exp(nll / cnt):.4f} ({len(chunks)} chunks of {args.ctx}, {cnt} tokens scored)", flush=True)
    if args.llama_perplexity:
        r = subprocess.run([args.llama_perplexity, "-m", gguf, "-f", str(text_file), "-c", str(args.ctx),
                            "-t", str(torch.get_num_threads())], capture_output=True, text=True, timeout=1200)
        m = re.search(r"Final estimate: PPL = ([0-9.]+)", r.stdout + r.stderr)
        print(f"llama.cpp llama-perplexity: perplexity {m.group(1) if m else 'not found: ' + (r.stderr[-300:])}")


if __name__ == "__main__":
    sys.exit(main())
