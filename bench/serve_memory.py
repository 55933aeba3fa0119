"""The server's resident memory (RSS) under repeated waves of concurrent streamed requests.

Serves a tiny Llama (the lean decoder, packed prefill, a 1 MiB prefix cache that evicts), sends
`--waves` waves of `--requests` streamed completions at once (random prompt and output lengths, n of
1-3, a third of the clients hanging up after a few chunks, all seeded), and prints one JSON line per
server setting: RSS in MiB when idle and after each wave, and /health's kv_cache_bytes at the end.
Settings: the defaults (`--kernel-cache 256`), PyTorch's own kernel caches (`--kernel-cache 1024`),
and 16 kernels per cache.

    python bench/serve_memory.py [--requests 200] [--waves 8]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import httpx
from serve import free_port, wait_ready

from grpolab.data.tasks import arithmetic
from grpolab.models.tiny_hf import save_tiny_model

ROOT = Path(__file__).resolve().parents[1]
SYSTEM = "You are a careful calculator. Think step by step and end with #### and the answer.\n"
SETTINGS = {"default": [], "kernel_cache_1024": ["--kernel-cache", "1024"], "kernel_cache_16": ["--kernel-cache", "16"]}


def requests(n: int, questions: list[str]) -> list[tuple[dict, int | None]]:
    rng = random.Random(0)
    out = []
    for i in range(n):
        prompt = (SYSTEM if rng.random() < 0.5 else "") + " ".join(rng.sample(questions, rng.randint(1, 4)))
        body = {"model": "m", "prompt": prompt, "max_tokens": rng.randint(1, 48), "n": rng.choice([1, 1, 2, 3]),
                "temperature": rng.choice([0.0, 0.7, 1.0]), "top_k": rng.choice([0, 20]), "seed": i, "stream": True}
        out.append((body, rng.randint(1, 4) if rng.random() < 1 / 3 else None))
    return out


async def wave(url: str, reqs: list[tuple[dict, int | None]]) -> None:
    async def one(ac: httpx.AsyncClient, body: dict, hang_up: int | None) -> None:
        chunks = 0
        async with ac.stream("POST", "/v1/completions", json=body) as r:
            async for line in r.aiter_lines():
                chunks += line.startswith("data: ")
                if hang_up is not None and chunks >= hang_up:
                    break
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=httpx.Limits(max_connections=None)) as ac:
        await asyncio.gather(*(one(ac, b, h) for b, h in reqs))


def rss_mib(pid: int) -> int:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS"):
            return int(line.split()[1]) // 1024
    raise RuntimeError("no VmRSS")


def health(url: str) -> dict:
    return json.loads(urllib.request.urlopen(url + "/health").read())


def run(model: Path, extra: list[str], reqs: list, waves: int) -> dict:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, "-m", "grpolab", "serve", str(model), "--port", str(port), "--name", "m",
                             "--max-batch", "32", "--prefix-cache-gib", str(2**20 / 2**30), "--log-level", "warning",
                             *extra], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_ready(url, proc)
        rss = [rss_mib(proc.pid)]
        for _ in range(waves):
            asyncio.run(wave(url, reqs))
            time.sleep(1)   # hung-up rows leave at the batcher's next step
            rss.append(rss_mib(proc.pid))
        return {"rss_mib": rss, "kv_cache_bytes_at_end": health(url)["kv_cache_bytes"]}
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--waves", type=int, default=8)
    args = p.parse_args()
    questions = [r["prompt"] for r in arithmetic.generate("test", 64, seed=3)]
    with tempfile.TemporaryDirectory() as tmp:
        model = save_tiny_model(Path(tmp) / "llama", [SYSTEM] + [q + "\n#### 3" for q in questions], vocab_size=300,
                                hidden=32, layers=2, heads=4, intermediate=64, max_positions=512)
        reqs = requests(args.requests, questions)
        for name, extra in SETTINGS.items():
            result = run(model, extra, reqs, args.waves)
            print(json.dumps({"setting": name, "args": extra, "requests": args.requests, **result}), flush=True)


if __name__ == "__main__":
    main()
