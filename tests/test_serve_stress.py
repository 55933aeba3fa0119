"""200 concurrent streamed requests against the real server (a tiny Llama: the lean decoder, packed
prefill in small chunks and a small prefix cache that must evict), with random prompt and output lengths, n of 1-3, and
a third of the clients hanging up mid-stream, twice. No request errs, the memory the server holds for keys
and values returns to its idle level after each wave (its own count, /health), the process's RSS after the
second wave is back near its level after the first (which filled its caches of compiled kernels; with
chunks of 32 prompt tokens there are few shapes), and every seeded request's text equals its run alone
(a cancelled one's streamed text is the start of it)."""

import asyncio
import json
import random
import time
import urllib.request

import httpx
import pytest
from conftest import running_server

from grpolab.data.tasks import arithmetic
from grpolab.models.tiny_hf import save_tiny_model

QUESTIONS = [r["prompt"] for r in arithmetic.generate("test", 64, seed=3)]
SYSTEM = "You are a careful calculator. Think step by step and end with #### and the answer.\n"
PREFIX_CACHE_GIB = 2**20 / 2**30   # 1 MiB: about 128 blocks of this model's 16 tokens, so it evicts
PREFILL_CHUNK = 32   # most prompts here are longer: they join in chunks while other rows decode


def _health(url: str) -> dict:
    return json.loads(urllib.request.urlopen(url + "/health").read())


def _settled(url: str) -> dict:
    """/health once nothing runs or waits (hung-up rows leave at the batcher's next step)."""
    for _ in range(200):
        h = _health(url)
        if h["running"] == h["waiting"] == h["kv_cache_bytes"] == 0:
            break
        time.sleep(0.05)
    return h


def _rss_mib(pid: int) -> float:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def _requests(n: int) -> list[dict]:
    """Random prompts (some after a shared system text, some not), lengths, n and hang-ups, seeded."""
    rng = random.Random(0)
    out = []
    for i in range(n):
        prompt = (SYSTEM if rng.random() < 0.5 else "") + " ".join(rng.sample(QUESTIONS, rng.randint(1, 4)))
        body = {"model": "tiny", "prompt": prompt, "max_tokens": rng.randint(1, 48), "n": rng.choice([1, 1, 2, 3]),
                "temperature": rng.choice([0.0, 0.7, 1.0]), "top_k": rng.choice([0, 20]), "seed": i}
        out.append({"body": body, "hang_up_after": rng.randint(1, 4) if rng.random() < 1 / 3 else None})
    return out


async def _stream(ac: httpx.AsyncClient, req: dict) -> tuple[dict[int, str], bool]:
    """Each choice's streamed text, and whether every choice got its finish_reason (False: hung up)."""
    texts: dict[int, str] = {}
    finished = set()
    chunks = 0
    async with ac.stream("POST", "/v1/completions", json={**req["body"], "stream": True}) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            data = json.loads(line[6:])
            assert "error" not in data, data
            for c in data["choices"]:
                texts[c["index"]] = texts.get(c["index"], "") + c["text"]
                if c["finish_reason"] is not None:
                    finished.add(c["index"])
            chunks += 1
            if req["hang_up_after"] is not None and chunks >= req["hang_up_after"]:
                break   # leaving the block closes the connection mid-stream
    return texts, len(finished) == req["body"]["n"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    texts = [SYSTEM] + [q + "\n#### 3" for q in QUESTIONS]
    return save_tiny_model(tmp_path_factory.mktemp("stress") / "llama", texts, vocab_size=300, hidden=32,
                           layers=2, heads=4, intermediate=64, max_positions=512)


@pytest.mark.slow
def test_200_streams_with_hang_ups_leave_nothing_behind_and_match_their_runs_alone(model_dir):
    reqs = _requests(200)
    with running_server(model_dir, "--name", "tiny", "--max-batch", "32", "--prefix-cache-gib",
                        str(PREFIX_CACHE_GIB), "--prefill-chunk", str(PREFILL_CHUNK)) as (url, proc):
        idle = _health(url)["kv_cache_bytes"]

        peak = 0

        async def watch(ac: httpx.AsyncClient, storm: asyncio.Future):
            nonlocal peak
            while not storm.done():
                peak = max(peak, (await ac.get("/health")).json()["kv_cache_bytes"])
                await asyncio.sleep(0.02)

        async def storm():
            async with httpx.AsyncClient(base_url=url, timeout=300,
                                         limits=httpx.Limits(max_connections=None)) as ac:
                streams = asyncio.gather(*(_stream(ac, r) for r in reqs))
                await watch(ac, streams)
                return await streams
        waves, rss = [], []
        for _ in range(2):
            waves.append(asyncio.run(storm()))
            h = _settled(url)
            rss.append(_rss_mib(proc.pid))
            assert (h["running"], h["waiting"], h["waiting_rows"]) == (0, 0, 0), h
            assert h["kv_cache_bytes"] == idle == 0, h
            assert 0 < h["prefix_cache_bytes"] <= 2**20, h
        # the running batch's keys and values, as counted plainly: at most 32 rows x 512 columns, each
        # column 2 layers x (keys and values) x 4 heads x 8 dims in float32 plus its mask entry
        assert 0 < peak <= 32 * 512 * (2 * 2 * 4 * 8 * 4 + 4) + 32 * 8, peak
        # the same load again leaves the process within a few MiB of where the first left it (592 and
        # 592-599 MiB here on this project's machine); a quarter MiB kept per request would add 50
        assert rss[1] - rss[0] < 48, rss

        alone = [httpx.post(url + "/v1/completions", json=r["body"], timeout=120).json() for r in reqs]

    for streamed in waves:
        hung_up = 0
        for req, (texts, complete), solo in zip(reqs, streamed, alone):
            want = {c["index"]: c["text"] for c in solo["choices"]}
            if complete:
                assert texts == want, req
            else:
                hung_up += 1
                assert req["hang_up_after"] is not None, req
                assert all(want[i].startswith(t) for i, t in texts.items()), req
        assert 40 <= hung_up <= 80   # the hang-ups happened (some requests end before their client leaves)
        assert len({t for texts, _ in streamed for t in texts.values()}) > 100   # not one text for all

