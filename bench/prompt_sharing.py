"""Which decode attention, by shape: a group's prompt keys/values shared (one copy per prompt, two-part
attention merged by log-sum-exp) or copied to every row (one attention call), measured on both
rollout shapes of bench/rollout.py. This is the measurement behind `lean_decode.SHARE_MIN_BYTES`.

  * tiny: bench/rollout.py's tiny Llama (hidden 128), 16 arithmetic prompts x 4 samples x 64 tokens;
  * realistic: bench/rollout.py's 54M Llama, 8 prompts of 128 tokens x 8 samples x 256 tokens (fixed).

Alternating (copies, shared, copies, shared, ...) after a warm-up, median of --runs; one JSON line with
each shape's tokens/s both ways, the prompt bytes per layer that sharing saves, and the ratio.

    python bench/prompt_sharing.py [--runs 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import rollout as R  # noqa: E402

from grpolab.data.tasks import arithmetic
from grpolab.models import lean_decode
from grpolab.models.hf import load_hf
from grpolab.models.tiny_hf import save_tiny_model
from grpolab.rollout.engine import generate


def timed(policy, prompts, G, new, pad, share: bool, seed: int) -> float:
    lean_decode.SHARE_MIN_BYTES = 0 if share else 2**62
    t = time.perf_counter()
    out = generate(policy, prompts, num_generations=G, max_new_tokens=new, temperature=1.0, stop_ids=(),
                   pad_id=pad, generator=torch.Generator().manual_seed(seed))
    dt = time.perf_counter() - t
    assert out.completion_ids.shape == (len(prompts) * G, new)
    return len(prompts) * G * new / dt


def compare(policy, prompts, G, new, pad, runs: int) -> dict:
    timed(policy, prompts, G, new, pad, False, 0), timed(policy, prompts, G, new, pad, True, 0)   # warm-up
    copies, shared = [], []
    for i in range(runs):
        copies.append(timed(policy, prompts, G, new, pad, False, i + 1))
        shared.append(timed(policy, prompts, G, new, pad, True, i + 1))
    c = policy.config
    width = max(map(len, prompts))
    kv_dim = c.num_key_value_heads * (c.hidden_size // c.num_attention_heads)
    saved = (G - 1) * len(prompts) * 2 * kv_dim * width * 4
    return {"copies_tok_s": round(statistics.median(copies)), "shared_tok_s": round(statistics.median(shared)),
            "ratio_shared_over_copies": round(statistics.median(shared) / statistics.median(copies), 3),
            "prompt_bytes_saved_per_layer": saved}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3)
    a = ap.parse_args()
    torch.set_num_threads(2)
    default = lean_decode.SHARE_MIN_BYTES
    rows = arithmetic.generate("test", R.PROMPTS, seed=0)
    with tempfile.TemporaryDirectory() as d:
        save_tiny_model(d, vocab_size=512, hidden=128, layers=4, heads=4, intermediate=512)
        tiny, tok = load_hf(d)
    res = {"bench": "prompt_sharing", "runs": a.runs, "share_min_bytes": default}
    res["tiny"] = compare(tiny, [tok.render_prompt(r["prompt"]) for r in rows], R.SAMPLES, R.NEW, tok.pad_id, a.runs)
    print(json.dumps(res["tiny"]), file=sys.stderr, flush=True)
    real = R.realistic_model()
    g = torch.Generator().manual_seed(1)
    prompts = torch.randint(3, R.R_VOCAB, (R.R_PROMPTS, R.R_PROMPT_LEN), generator=g).tolist()
    res["realistic"] = compare(real, prompts, R.R_SAMPLES, R.R_NEW, 0, a.runs)
    for shape in ("tiny", "realistic"):
        res[shape]["auto_shares"] = res[shape]["prompt_bytes_saved_per_layer"] >= default
    print(json.dumps(res))


if __name__ == "__main__":
    main()
