"""Our Llama / Qwen2 / Qwen3 over the paged KV cache against Hugging Face transformers (fp32).

Small random-weight models are built with transformers and saved to a temp dir; we load the
directory with `minisgl.weights.load_model` and check that the logits of a mixed, chunked prefill
and of several decode steps (requests scattered over non-contiguous pages) match HF's full forward.
"""
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

from minisgl.models import ForwardContext
from minisgl.weights import load_model

SMALL = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
             initializer_range=0.1)

CONFIGS = {
    "llama": lambda: LlamaConfig(**SMALL),
    "llama-tied-bias-llama3rope": lambda: LlamaConfig(
        **SMALL, tie_word_embeddings=True, attention_bias=True, mlp_bias=True,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 16}),
    "llama-linear-rope": lambda: LlamaConfig(
        **SMALL, rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}),
    "qwen2": lambda: Qwen2Config(**SMALL),
    "qwen2-yarn": lambda: Qwen2Config(
        **SMALL, rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                  "original_max_position_embeddings": 32}),
    "qwen3": lambda: Qwen3Config(**{**SMALL, "num_key_value_heads": 1}, head_dim=24, tie_word_embeddings=True),
}

PAGE, NUM_PAGES = 4, 128


class PagedKV:
    "A stand-in for the scheduler's bookkeeping: per-request rows of a page table over shuffled pages."
    def __init__(self, model, num_rows: int, max_len: int, gen: torch.Generator):
        cfg = model.cfg
        self.kv = [(torch.zeros(NUM_PAGES * PAGE, cfg.num_kv_heads, cfg.head_dim),
                    torch.zeros(NUM_PAGES * PAGE, cfg.num_kv_heads, cfg.head_dim)) for _ in range(cfg.num_layers)]
        self.page_table = torch.zeros(num_rows + 1, max_len, dtype=torch.int32)
        pages = torch.randperm(NUM_PAGES, generator=gen)
        per_row = max_len // PAGE
        for r in range(num_rows):
            row_pages = pages[r * per_row:(r + 1) * per_row]
            self.page_table[r + 1] = (row_pages[:, None] * PAGE + torch.arange(PAGE)).reshape(-1)[:max_len].int()

    def forward(self, model, rows, tokens, starts, is_prefill, all_logits=False):
        "rows[b] computes tokens[b] at positions starts[b]..; returns logits (last of each or all rows)."
        ids = torch.tensor([t for ts in tokens for t in ts])
        pos = torch.tensor([s + i for ts, s in zip(tokens, starts) for i in range(len(ts))])
        out_loc = torch.cat([self.page_table[r, s:s + len(ts)] for r, ts, s in zip(rows, tokens, starts)]).long()
        ext = torch.tensor([len(ts) for ts in tokens], dtype=torch.int32)
        seq = torch.tensor([s + len(ts) for ts, s in zip(tokens, starts)], dtype=torch.int32)
        ctx = ForwardContext(is_prefill, out_loc, self.page_table, torch.tensor(rows, dtype=torch.int32),
                             seq, ext, self.kv)
        idx = None if all_logits else ext.long().cumsum(0) - 1
        with torch.no_grad():
            return model(ids, pos, ctx, idx)


@pytest.fixture(params=list(CONFIGS), scope="module")
def pair(request, tmp_path_factory):
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(CONFIGS[request.param](), attn_implementation="eager").eval()
    d = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(d)
    return hf, load_model(d, torch.float32, max_seq_len=128)


def hf_logits(hf, ids):
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0]


def test_prefill_and_decode_match_hf(pair):
    hf, ours = pair
    gen = torch.Generator().manual_seed(1)
    lens = [1, 7, 23]
    prompts = [torch.randint(0, 128, (n,), generator=gen).tolist() for n in lens]
    kv = PagedKV(ours, len(prompts), 64, gen)
    rows = [1, 2, 3]
    tol = dict(atol=2e-4, rtol=2e-4)

    # prefill 1: requests 0 and 1 whole, request 2's first chunk of 10 tokens; every position's logits
    got = kv.forward(ours, rows, [prompts[0], prompts[1], prompts[2][:10]], [0, 0, 0], True, all_logits=True)
    want = torch.cat([hf_logits(hf, prompts[0]), hf_logits(hf, prompts[1]), hf_logits(hf, prompts[2][:10])])
    torch.testing.assert_close(got, want, **tol)

    # prefill 2: the rest of request 2 on top of its cached prefix (chunked prefill / prefix hit)
    got = kv.forward(ours, [3], [prompts[2][10:]], [10], True, all_logits=True)
    torch.testing.assert_close(got, hf_logits(hf, prompts[2])[10:], **tol)

    # decode: all three together, each step feeding HF's greedy token
    seqs = [list(p) for p in prompts]
    for _ in range(5):
        want = torch.stack([hf_logits(hf, s)[-1] for s in seqs])
        for s, w in zip(seqs, want): s.append(int(w.argmax()))
        got = kv.forward(ours, rows, [[s[-1]] for s in seqs], [len(s) - 1 for s in seqs], False)
        torch.testing.assert_close(got, torch.stack([hf_logits(hf, s)[-1] for s in seqs]), **tol)


def test_last_position_only(pair):
    "Prefill with logits_idx returns exactly the last-position rows of the full logits."
    hf, ours = pair
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 128, (n,), generator=gen).tolist() for n in (5, 3)]
    kv = PagedKV(ours, 2, 16, gen)
    last = kv.forward(ours, [1, 2], prompts, [0, 0], True)
    full = kv.forward(ours, [1, 2], prompts, [0, 0], True, all_logits=True)
    torch.testing.assert_close(last, full[[4, 7]])


def test_unsupported_rope_is_a_clear_error(tmp_path):
    cfg = LlamaConfig(**SMALL)
    hf = AutoModelForCausalLM.from_config(cfg)
    hf.save_pretrained(tmp_path)
    import json
    c = json.loads((tmp_path / "config.json").read_text())
    c["rope_parameters"] = {"rope_type": "longrope", "rope_theta": 10000.0, "long_factor": [1.0] * 8,
                            "short_factor": [1.0] * 8}
    (tmp_path / "config.json").write_text(json.dumps(c))
    with pytest.raises(ValueError, match="longrope"):
        load_model(tmp_path)
