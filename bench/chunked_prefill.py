"""Chunked prefill (serve/batcher.py PREFILL_CHUNK): what a long prompt arriving mid-stream costs the streams
already decoding, with the prompt prefilled whole (--prefill-chunk 0) and in chunks.

Model: SmolLM2-135M-Instruct (`make smollm2`), float32, one thread, the server's batcher in process (no
HTTP). Load: --streams chat prompts (held-out GSM8K-easy problems, as bench/vs_vllm.py's serving load)
decoding --max-tokens greedy tokens each; after --arrive-at steps a prompt of --long tokens (GSM8K
problems concatenated) arrives, asking for 8 tokens. Per setting, alternating (0, 512, 256, 0, ...) after
a warm-up, the median over --runs of: the longest step while the streams decode (the longest pause
between two of their tokens), the median step, the long prompt's time to first token, and the time the
whole load takes. One JSON line per setting; `--update` appends them to bench/results/chunked_prefill.jsonl.

    python bench/chunked_prefill.py [--runs 3] [--update]
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

from grpolab.serve.batcher import Job, SamplingParams  # noqa: E402
from grpolab.serve.model_loader import load_engine  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CHUNKS = (0, 512, 256)


def one_run(batcher, streams: list[list[int]], long: list[int], args) -> dict:
    jobs = [Job(p, SamplingParams(max_tokens=args.max_tokens, temperature=0.0)) for p in streams]
    late = Job(long, SamplingParams(max_tokens=8, temperature=0.0))
    for j in jobs:
        batcher.submit(j)
    steps, arrived, start = [], None, time.perf_counter()
    while not batcher.idle() or arrived is None:
        if len(steps) == args.arrive_at:
            arrived = time.monotonic()
            batcher.submit(late)
        decoding = any(not c.done for j in jobs for c in j.choices)
        t = time.perf_counter()
        batcher.step()
        if decoding and len(steps) >= 1:   # the first step prefills the streams' prompts
            steps.append(time.perf_counter() - t)
        elif not steps:
            steps.append(0.0)
    wall = time.perf_counter() - start
    assert all(c.done for j in jobs + [late] for c in j.choices)
    return {"longest_step_s": max(steps), "median_step_s": statistics.median(steps[1:]),
            "long_ttft_s": late.prefilled_at - arrived, "wall_s": wall,
            "tokens": [c.tokens for j in jobs + [late] for c in j.choices]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--long", type=int, default=1536)
    ap.add_argument("--arrive-at", type=int, default=8)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--update", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    model = ROOT / "models" / "SmolLM2-135M-Instruct"
    batcher, tok, _ = load_engine(str(model), max_batch=args.streams + 1, prefix_cache_gib=0)
    rows = sm.eval_rows(args.streams + 64, model, sm.Setting())
    streams = [tok.render_prompt(r["prompt"]) for r in rows[:args.streams]]
    long: list[int] = []
    for r in rows[args.streams:]:
        long += tok.render_prompt(r["prompt"])
    long = long[:args.long]
    assert len(long) == args.long, len(long)
    results: dict[int, list[dict]] = {c: [] for c in CHUNKS}
    for run in range(args.runs + 1):   # run 0 warms every shape up
        for c in CHUNKS:
            batcher.prefill_chunk = c
            r = one_run(batcher, streams, long, args)
            if run:
                results[c].append(r)
    tokens = {c: [r["tokens"] for r in rs] for c, rs in results.items()}
    same = all(t == tokens[0][0] for ts in tokens.values() for t in ts)
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S")
    lines = []
    for c, rs in results.items():
        med = {k: round(statistics.median(r[k] for r in rs), 3)
               for k in ("longest_step_s", "median_step_s", "long_ttft_s", "wall_s")}
        lines.append({"bench": "chunked_prefill", "when": stamp, "prefill_chunk": c, "streams": args.streams,
                      "max_tokens": args.max_tokens, "long_prompt": args.long, "runs": args.runs,
                      **med, "same_tokens_every_setting": same})
    for line in lines:
        print(json.dumps(line), flush=True)
    if args.update:
        with open(ROOT / "bench" / "results" / "chunked_prefill.jsonl", "a") as f:
            for line in lines:
                f.write(json.dumps(line) + "\n")


if __name__ == "__main__":
    main()
