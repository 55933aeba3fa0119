"""Serving throughput: 64 chat requests sent at once vs the same 64 one at a time.

Starts `grpolab serve` on a built-in model checkpoint (default: the demo's latest checkpoint under
runs/demo, else a quick warm start written to runs/bench-serve) and talks to it with the real
`openai` async client: greedy (temperature 0) chat completions of 64 arithmetic problems, first
one at a time, then all concurrently. Prints one JSON line: requests/s, completion tokens/s,
p50/p99 latency of each, the throughput ratio (median of alternating rounds), and whether the
greedy texts are identical in every round.

    python bench/serve.py [--model CKPT] [--requests 64] [--max-tokens 96] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def default_model() -> str:
    from grpolab.models.checkpoint import list_checkpoints
    for run in ("runs/demo", "runs/bench-serve"):
        found = list_checkpoints(ROOT / run / "checkpoints")
        if found:
            return str(found[-1])
    out = ROOT / "runs" / "bench-serve"
    print("no demo checkpoint: warm-starting one with `grpolab sft` (about a minute)", file=sys.stderr)
    subprocess.run([sys.executable, "-m", "grpolab", "sft", f"train.output_dir={out}"], check=True, cwd=ROOT,
                   stdout=subprocess.DEVNULL)
    return str(list_checkpoints(out / "checkpoints")[-1])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, proc: subprocess.Popen, timeout: float = 120, log: Path | None = None) -> float:
    """Seconds until `url`/health answers; RuntimeError (with the tail of `log`, the server's output file)
    if the server exits first or takes longer than `timeout`."""
    t0 = time.time()
    while time.time() - t0 < timeout:
        if proc.poll() is not None:
            tail = f":\n{log.read_text()[-3000:]}" if log is not None else ""
            raise RuntimeError(f"the server exited ({proc.returncode}) before it was ready{tail}")
        try:
            urllib.request.urlopen(url + "/health", timeout=1)
            return time.time() - t0
        except OSError:
            time.sleep(0.2)
    raise RuntimeError(f"the server at {url} did not become ready in {timeout:.0f} s")


async def one(client, model: str, question: str, max_tokens: int) -> tuple[str, int, float]:
    t = time.perf_counter()
    r = await client.chat.completions.create(model=model, messages=[{"role": "user", "content": question}],
                                             temperature=0, max_tokens=max_tokens)
    return r.choices[0].message.content, r.usage.completion_tokens, time.perf_counter() - t


def summary(results: list, wall: float) -> dict:
    lat = sorted(r[2] for r in results)
    tokens = sum(r[1] for r in results)
    return {"wall_s": round(wall, 3), "requests_per_s": round(len(results) / wall, 2),
            "tokens_per_s": round(tokens / wall, 1), "p50_s": round(statistics.median(lat), 4),
            "p99_s": round(lat[min(len(lat) - 1, int(0.99 * len(lat)))], 4), "completion_tokens": tokens}


async def bench(url: str, model: str, questions: list[str], max_tokens: int, rounds: int) -> dict:
    import openai
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)
    await one(client, model, questions[0], max_tokens)   # warm-up, both ways
    await asyncio.gather(*(one(client, model, q, max_tokens) for q in questions))
    runs = []
    for _ in range(rounds):   # alternating, so both see the same machine load
        t = time.perf_counter()
        seq = [await one(client, model, q, max_tokens) for q in questions]
        seq_wall = time.perf_counter() - t
        t = time.perf_counter()
        conc = await asyncio.gather(*(one(client, model, q, max_tokens) for q in questions))
        conc_wall = time.perf_counter() - t
        s, c = summary(seq, seq_wall), summary(conc, conc_wall)
        runs.append((c["tokens_per_s"] / s["tokens_per_s"], s, c, [r[0] for r in seq] == [r[0] for r in conc]))
    await client.close()
    ratio, s, c, _ = sorted(runs, key=lambda r: r[0])[len(runs) // 2]   # the median round
    return {"bench": "serve", "requests": len(questions), "max_tokens": max_tokens, "rounds": rounds,
            "one_at_a_time": s, "concurrent": c, "throughput_ratio": round(ratio, 2),
            "ratios": [round(r[0], 2) for r in runs], "greedy_identical": all(r[3] for r in runs)}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default=None, help="built-in checkpoint to serve (default: see above)")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds; the median round is reported")
    args = p.parse_args()
    model = args.model or default_model()
    from grpolab.data.tasks import arithmetic
    questions = [r["prompt"] for r in arithmetic.generate("test", args.requests, seed=1)]
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, "-m", "grpolab", "serve", model, "--port", str(port), "--name", "m",
                             "--max-batch", str(args.requests), "--log-level", "warning"],
                            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        wait_ready(url, proc)
        result = asyncio.run(bench(url, "m", questions, args.max_tokens, args.rounds))
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)
    result["model"] = os.path.relpath(model, ROOT) if model.startswith(str(ROOT)) else model
    print(json.dumps(result))


if __name__ == "__main__":
    main()
