"""Rollout throughput: our engine vs transformers' `generate` on the same tiny Llama.

16 prompts x 4 samples x exactly 64 new tokens, temperature 1.0, fp32, CPU, 2 threads.
Runs alternate (ours, HF, ours, HF, ...) after a warm-up; reports the median of each and the
ratio as one JSON line. Also times the built-in GPT (ours only).

    python bench/rollout.py [--runs 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import torch

from grpolab.data.tasks import arithmetic
from grpolab.models import CharTokenizer, GPT, GPTConfig
from grpolab.models.hf import load_hf
from grpolab.models.tiny_hf import save_tiny_model
from grpolab.rollout.engine import generate

PROMPTS, SAMPLES, NEW = 16, 4, 64


def ours(model, prompts, pad_id, seed):
    g = torch.Generator().manual_seed(seed)
    t = time.perf_counter()
    out = generate(model, prompts, num_generations=SAMPLES, max_new_tokens=NEW, temperature=1.0,
                   stop_ids=(), pad_id=pad_id, generator=g)   # no stop ids: exactly NEW tokens
    dt = time.perf_counter() - t
    assert out.completion_ids.shape == (PROMPTS * SAMPLES, NEW)
    return PROMPTS * SAMPLES * NEW / dt


def hf(model, prompts, pad_id, seed):
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    torch.manual_seed(seed)
    t = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=mask, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                             max_new_tokens=NEW, min_new_tokens=NEW, num_return_sequences=SAMPLES,
                             pad_token_id=pad_id, eos_token_id=None)
    dt = time.perf_counter() - t
    assert out.shape[1] - width == NEW
    return PROMPTS * SAMPLES * NEW / dt


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(2)
    rows = arithmetic.generate("test", PROMPTS, seed=0)
    with tempfile.TemporaryDirectory() as d:
        save_tiny_model(d, vocab_size=512, hidden=128, layers=4, heads=4, intermediate=512)
        policy, tok = load_hf(d)
    prompts = [tok.render_prompt(r["prompt"]) for r in rows]
    a, b = [], []
    ours(policy, prompts, tok.pad_id, 0), hf(policy.hf, prompts, tok.pad_id, 0)   # warm-up
    for i in range(args.runs):
        a.append(ours(policy, prompts, tok.pad_id, i + 1))
        b.append(hf(policy.hf, prompts, tok.pad_id, i + 1))
    ctok = CharTokenizer()
    torch.manual_seed(0)
    gpt = GPT(GPTConfig(vocab_size=ctok.vocab_size, n_layer=4, n_head=4, n_embd=128, block_size=160)).eval()
    cprompts = [ctok.render_prompt(r["prompt"]) for r in rows]
    ours(gpt, cprompts, ctok.pad_id, 0)
    c = [ours(gpt, cprompts, ctok.pad_id, i + 1) for i in range(args.runs)]
    print(json.dumps({
        "bench": "rollout", "prompts": PROMPTS, "samples": SAMPLES, "new_tokens": NEW, "runs": args.runs,
        "tiny_llama_ours_tok_s": round(statistics.median(a)), "tiny_llama_hf_generate_tok_s": round(statistics.median(b)),
        "ratio_ours_over_hf": round(statistics.median(a) / statistics.median(b), 2),
        "builtin_gpt_ours_tok_s": round(statistics.median(c)), "torch": torch.__version__}))


if __name__ == "__main__":
    main()
