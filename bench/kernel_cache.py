"""What `grpolab serve --kernel-cache N` costs and saves on the real model: tokens/s and resident memory.

Two or more `grpolab serve` processes on SmolLM2-135M-Instruct (1 thread each, --max-batch 64), one per
--caches value, all up at once; bench/vs_vllm.py's serving load (streamed chat completions of GSM8K-easy
problems, temperature 0, --max-tokens each) at each --concurrency, rounds alternating the servers. After
every round the server's RSS (/proc) is read: it grows while its caches of compiled matrix-product kernels
fill (one kernel per rows x weight shape, about 0.3 MiB each) and stays flat once they are full.
One JSON line per round and one summary line (median tokens/s per setting and level, RSS after each round)
go to stdout and, with --update, to bench/results/kernel_cache.jsonl.

    python bench/kernel_cache.py [--caches 1024 256] [--concurrency 8 64] [--runs 3] [--update]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
import _smollm2 as sm  # noqa: E402
from _load import bench_module  # noqa: E402
from serve_memory import rss_mib  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--caches", nargs="+", default=["1024", "256"], help="--kernel-cache values, one server each")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[8, 64])
    ap.add_argument("--requests", type=int, default=64, help="requests per round (at least the concurrency)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--runs", type=int, default=3, help="rounds per server and level")
    ap.add_argument("--update", action="store_true", help="append the lines to bench/results/kernel_cache.jsonl")
    args = ap.parse_args()
    vv = bench_module("vs_vllm")   # its load, server start and stop
    model = ROOT / "models" / "SmolLM2-135M-Instruct"
    questions = [r["prompt"] for r in sm.eval_rows(max(args.requests, *args.concurrency), model, sm.Setting())]
    work = Path(tempfile.mkdtemp())
    ports = {c: vv.sb.free_port() for c in args.caches}
    procs = {c: vv.start([sys.executable, "-m", "grpolab.cli", "serve", str(model), "--port", str(ports[c]),
                          "--name", "smollm2", "--max-batch", "64", "--log-level", "warning",
                          "--kernel-cache", c], work / f"{c}.log") for c in args.caches}
    lines, stamp = [], time.strftime("%Y-%m-%dT%H:%M:%S")
    try:
        urls = {c: f"http://127.0.0.1:{ports[c]}" for c in args.caches}
        rss = {c: [] for c in args.caches}
        for c in args.caches:
            vv.sb.wait_ready(urls[c], procs[c], 300, work / f"{c}.log")
            rss[c].append(rss_mib(procs[c].pid))   # ready, nothing served yet
        rounds = {(c, k): [] for c in args.caches for k in args.concurrency}
        for i in range(args.runs):
            for k in args.concurrency:
                for c in args.caches if i % 2 == 0 else args.caches[::-1]:
                    r = asyncio.run(vv.load_round(urls[c], questions[:max(args.requests, k)], k, args.max_tokens))
                    r.pop("texts")
                    rss[c].append(rss_mib(procs[c].pid))
                    rounds[(c, k)].append(r)
                    lines.append({"bench": "kernel_cache", "when": stamp, "kernel_cache": int(c), "concurrency": k,
                                  "round": i, "rss_mib": rss[c][-1], **r})
                    print(json.dumps(lines[-1]), flush=True)
        lines.append({"bench": "kernel_cache", "when": stamp, "runs": args.runs, "max_tokens": args.max_tokens,
                      "requests": args.requests, "command": "python " + " ".join(sys.argv),
                      "median_tok_s": {f"{c}@{k}": round(statistics.median(r["output_tok_s"] for r in rs), 1)
                                       for (c, k), rs in rounds.items()},
                      "rss_mib_after_each_round": rss})
        print(json.dumps(lines[-1]), flush=True)
    finally:
        for p in procs.values():
            vv.stop(p)
    if args.update:
        with open(ROOT / "bench" / "results" / "kernel_cache.jsonl", "a") as f:
            f.writelines(json.dumps(x) + "\n" for x in lines)


if __name__ == "__main__":
    main()
