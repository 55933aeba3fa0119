"""The server's prefill three ways on the same prompts: left-padded (the lean decoder's batch forward, what
the server ran before), packed (models/lean_prefill.py: no padding, attention prompt by prompt), and packed
continuing from a warm prefix cache (serve/prefix_cache.py, every prompt seen once before).

Model: SmolLM2-135M-Instruct (`make smollm2`), float32, one thread; prompts: the first --prompts held-out
GSM8K-easy chat prompts (system prompt + problem), as bench/vs_vllm.py's serving load sends them.
Alternating (padded, packed, cached, padded, ...) after a warm-up, median of --runs; one JSON line with
prompt tokens/s each way, the padding share of the padded batch, and the ratios.

    OMP_NUM_THREADS=1 python bench/prefill.py [--prompts 64] [--runs 3]
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _smollm2 as sm  # noqa: E402

from grpolab.models.lean_prefill import packed_prefill  # noqa: E402
from grpolab.serve.model_loader import load_engine  # noqa: E402
from grpolab.serve.prefix_cache import PrefixCache  # noqa: E402
from grpolab.utils.padding import pad_sequences  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)
    model = ROOT / "models" / "SmolLM2-135M-Instruct"
    batcher, tok, _ = load_engine(str(model), max_batch=args.prompts, prefix_cache_gib=0)
    d = batcher.decoder
    prompts = [tok.render_prompt(r["prompt"]) for r in sm.eval_rows(args.prompts, model, sm.Setting())]
    ids, valid = pad_sequences(prompts, tok.pad_id, "left")
    real = sum(map(len, prompts))
    warm = PrefixCache(2**32)
    for p, kv in zip(prompts, packed_prefill(d, prompts, [None] * len(prompts))[0]):
        warm.store(p, kv)

    def padded():
        d.forward(ids, valid, d.new_cache(len(prompts), ids.size(1)), 1)

    def packed():
        packed_prefill(d, prompts, [None] * len(prompts))

    def cached():
        prefixes = [warm.lookup(p) for p in prompts]
        packed_prefill(d, [p[x.size(2):] if x is not None else p for p, x in zip(prompts, prefixes)], prefixes)

    ways = {"padded": padded, "packed": packed, "cached": cached}
    times = {k: [] for k in ways}
    with torch.inference_mode():
        for f in ways.values():   # warm-up
            f()
        for _ in range(args.runs):
            for k, f in ways.items():
                t = time.perf_counter()
                f()
                times[k].append(time.perf_counter() - t)
    tok_s = {k: round(real / statistics.median(v), 1) for k, v in times.items()}
    print(json.dumps({"bench": "prefill", "prompts": len(prompts), "prompt_tokens": real,
                      "padded_width": ids.size(1), "padding_share": round(1 - real / ids.numel(), 3),
                      "prompt_tok_s": tok_s, "packed_over_padded": round(tok_s["packed"] / tok_s["padded"], 2),
                      "cached_over_padded": round(tok_s["cached"] / tok_s["padded"], 2),
                      "runs": args.runs, "threads": 1, "loadavg_1m": os.getloadavg()[0]}))


if __name__ == "__main__":
    main()
