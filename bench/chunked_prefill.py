"""Chunked prefill (serve/batcher.py PREFILL_CHUNK): what a long prompt arriving mid-stream costs the streams
already decoding, with the prompt prefilled whole (--prefill-chunk 0) and in chunks.

Model: SmolLM2-135M-Instruct (`make smollm2`), float32, one thread, the server's batcher in process (no HTTP;
--max-batch 64, the server's default). Load: --streams chat prompts (held-out GSM8K-easy problems, as
bench/vs_vllm.py's serving load) decoding --max-tokens greedy tokens each; after --arrive-at steps a prompt of
--long tokens (GSM8K problems concatenated) arrives, asking for 8 tokens. Per setting, alternating (0, 512,
256, 0, ...) after a warm-up, the median over --runs of: the longest step while the streams decode (the
longest pause between two of their tokens), the median step, the long prompt's time to first token, and the
time the whole load takes. One JSON line per setting; `--update` appends them to
bench/results/chunked_prefill.jsonl.

`--serving C`: whether the default chunk costs the ordinary serving load anything: two `grpolab serve`
processes (one thread each), --prefill-chunk 0 and 512, take turns (order swapped every round) at
bench/vs_vllm.py's load (streamed greedy chat requests of 64 tokens, C in flight, 3C requests); one
JSON line per round and one with the medians.

    python bench/chunked_prefill.py [--runs 3] [--update]
    python bench/chunked_prefill.py --serving 8 [--runs 6] [--update]
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse  # noqa: E402
import asyncio  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _smollm2 as sm  # noqa: E402
from _load import bench_module  # noqa: E402

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


def serving(args) -> list[dict]:
    vv = bench_module("vs_vllm")   # its load, server start and stop
    model = ROOT / "models" / "SmolLM2-135M-Instruct"
    questions = [r["prompt"] for r in sm.eval_rows(3 * args.serving, model, sm.Setting())]
    work = Path(tempfile.mkdtemp())
    settings = ("0", "512")
    ports = {c: vv.sb.free_port() for c in settings}
    procs = {c: vv.start([sys.executable, "-m", "grpolab.cli", "serve", str(model), "--port", str(ports[c]),
                          "--name", "smollm2", "--max-batch", "64", "--log-level", "warning",
                          "--prefill-chunk", c], work / f"{c}.log") for c in settings}
    lines, stamp = [], time.strftime("%Y-%m-%dT%H:%M:%S")
    try:
        urls = {c: f"http://127.0.0.1:{ports[c]}" for c in settings}
        for c in settings:
            vv.sb.wait_ready(urls[c], procs[c], 300, work / f"{c}.log")
            asyncio.run(vv.load_round(urls[c], questions, args.serving, 8))   # warm-up
        rounds: dict[str, list[dict]] = {c: [] for c in settings}
        for i in range(args.runs):
            for c in settings if i % 2 == 0 else settings[::-1]:
                r = asyncio.run(vv.load_round(urls[c], questions, args.serving, 64))
                r.pop("texts")
                rounds[c].append(r)
                lines.append({"bench": "chunked_prefill_serving", "when": stamp, "prefill_chunk": int(c),
                              "concurrency": args.serving, "round": i, **r})
                print(json.dumps(lines[-1]), flush=True)
        med = {c: {k: round(statistics.median(r[k] for r in rs), 3)
                   for k in ("output_tok_s", "p50_ttft_s", "p99_ttft_s", "p50_latency_s")} for c, rs in rounds.items()}
        lines.append({"bench": "chunked_prefill_serving", "when": stamp, "concurrency": args.serving,
                      "rounds": args.runs, "median": med,
                      "tok_s_512_over_0": round(med["512"]["output_tok_s"] / med["0"]["output_tok_s"], 3)})
        print(json.dumps(lines[-1]), flush=True)
    finally:
        for p in procs.values():
            vv.stop(p)
    return lines


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--max-batch", type=int, default=64, help="the batcher's rows at most (the server's default)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--long", type=int, default=1536)
    ap.add_argument("--arrive-at", type=int, default=8)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--serving", type=int, default=0, help="requests in flight (0: the arrival load instead)")
    ap.add_argument("--update", action="store_true")
    args = ap.parse_args()
    if args.serving:
        lines = serving(args)
        if args.update:
            with open(ROOT / "bench" / "results" / "chunked_prefill.jsonl", "a") as f:
                f.writelines(json.dumps(line) + "\n" for line in lines)
        return
    torch.set_num_threads(1)
    model = ROOT / "models" / "SmolLM2-135M-Instruct"
    batcher, tok, _ = load_engine(str(model), max_batch=args.max_batch, prefix_cache_gib=0)
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
                      "max_batch": args.max_batch,
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
