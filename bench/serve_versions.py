"""`grpolab serve` at one git revision against the working tree, on the same load, alternating.

Model: SmolLM2-135M-Instruct (`make smollm2`), float32, one thread per server, `--max-batch 64`. The
revision's source is exported (`git archive`, the repository untouched) to a temporary directory and served
from there with this Python; the working tree is served as it is. Load: bench/vs_vllm.py's (streamed greedy
chat completions of held-out GSM8K-easy problems, 64 tokens at most, --concurrency in flight, 2 x that many
requests), after a warm-up wave. The servers take turns, one up at a time, the order swapped every round.
One JSON line per round and one with the medians (tokens/s and first-token times); `--update` appends them
to bench/results/serve_versions.jsonl.

    python bench/serve_versions.py --base REV [--concurrency 64] [--rounds 2] [--update]
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse  # noqa: E402
import asyncio  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
import _smollm2 as sm  # noqa: E402
from _load import bench_module  # noqa: E402


def export(rev: str, into: Path) -> str:
    """The revision's files under `into`; returns its commit id."""
    commit = subprocess.run(["git", "rev-parse", rev], cwd=ROOT, check=True, capture_output=True,
                            text=True).stdout.strip()
    archive = subprocess.run(["git", "archive", commit], cwd=ROOT, check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return commit


def one_round(vv, tree: Path, model: Path, questions: list, args, log: Path) -> dict:
    """Start the server from `tree`, warm it up, time one wave, stop it."""
    port = vv.sb.free_port()
    proc = vv.start([sys.executable, "-m", "grpolab.cli", "serve", str(model), "--port", str(port), "--name",
                     "smollm2", "--max-batch", "64", "--log-level", "warning"], log, tree)
    try:
        url = f"http://127.0.0.1:{port}"
        vv.sb.wait_ready(url, proc, 300, log)
        asyncio.run(vv.load_round(url, questions[:args.concurrency], args.concurrency, 8))   # warm-up
        r = asyncio.run(vv.load_round(url, questions, args.concurrency, 64))
    finally:
        vv.stop(proc)
    r.pop("texts")
    return r


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", required=True, help="the git revision to compare the working tree with")
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--update", action="store_true")
    args = ap.parse_args()
    vv = bench_module("vs_vllm")   # its load, server start and stop
    model = sm.resolve_model("smollm2")
    sm.ensure_data()
    questions = [r["prompt"] for r in sm.eval_rows(2 * args.concurrency, model, sm.Setting())]
    work = Path(tempfile.mkdtemp())
    (work / "base").mkdir()
    trees = {"base": work / "base", "head": ROOT}
    commit = export(args.base, trees["base"])
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S")
    lines, rounds = [], {k: [] for k in trees}
    for i in range(args.rounds):
        for side in ("base", "head") if i % 2 == 0 else ("head", "base"):
            r = one_round(vv, trees[side], model, questions, args, work / f"{side}{i}.log")
            rounds[side].append(r)
            lines.append({"bench": "serve_versions", "when": stamp, "side": side, "round": i,
                          "concurrency": args.concurrency, **r})
            print(json.dumps(lines[-1]), flush=True)
    keys = ("output_tok_s", "p50_ttft_s", "p50_latency_s")
    med = {k: {m: round(statistics.median(r[m] for r in rs), 3) for m in keys} for k, rs in rounds.items()}
    lines.append({"bench": "serve_versions", "when": stamp, "base": commit, "head": "working tree",
                  "concurrency": args.concurrency, "rounds": args.rounds, "median": med,
                  "tok_s_head_over_base": round(med["head"]["output_tok_s"] / med["base"]["output_tok_s"], 3),
                  "command": "python " + " ".join(sys.argv)})
    print(json.dumps(lines[-1]), flush=True)
    if args.update:
        with open(ROOT / "bench" / "results" / "serve_versions.jsonl", "a") as f:
            f.writelines(json.dumps(line) + "\n" for line in lines)


if __name__ == "__main__":
    main()
