"""The server's packed prefill (models/lean_prefill.py) and prefix cache (serve/prefix_cache.py), on a real
tiny Llama: a prompt's keys, values and logits are its own (the same bits alone, packed with others, or
continued from its cached prefix), they agree with the model's Hugging Face forward, and a batcher with the
cache gives the same tokens as one without while prefilling fewer positions."""

from __future__ import annotations

import asyncio
import json
import random
import time

import httpx
import pytest
import torch
from conftest import running_server, staggered

from grpolab.data.tasks import arithmetic
from grpolab.models.hf import load_hf
from grpolab.models.lean_decode import LeanCache, LeanDecoder
from grpolab.models.lean_prefill import packed_prefill
from grpolab.models.tiny_hf import save_tiny_model
from grpolab.serve.batcher import Batcher, Job, SamplingParams
from grpolab.serve.prefix_cache import BLOCK, PrefixCache

QUESTIONS = [r["prompt"] for r in arithmetic.generate("test", 16, seed=4)]
SYSTEM = "You are a careful calculator. Think, then answer after ####. " * 2


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    d = save_tiny_model(tmp_path_factory.mktemp("llama"), [SYSTEM] + [q + "\n#### 3" for q in QUESTIONS],
                        vocab_size=300, hidden=32, layers=2, heads=4, kv_heads=2, intermediate=64)
    model, tok = load_hf(str(d))
    model.eval()
    with torch.no_grad():
        model.hf.lm_head.weight.mul_(3)   # tied to the embeddings: a mild scale, so greedy text varies
        decoder = LeanDecoder(model.hf, 512)
    return model, tok, decoder, d


def _prompts(tok, n):
    return [tok.encode(SYSTEM + q) for q in QUESTIONS[:n]]


@torch.inference_mode()
def test_packed_prefill_is_each_prompts_own_and_agrees_with_the_hf_forward(llama):
    model, tok, d, _ = llama
    prompts = _prompts(tok, 5)
    prompts[1] = prompts[1][:7]   # lengths differ a lot
    kvs, logits = packed_prefill(d, prompts, [None] * len(prompts))
    for i, p in enumerate(prompts):
        kv1, logits1 = packed_prefill(d, [p], [None])   # alone
        assert torch.equal(kv1[0], kvs[i]) and torch.equal(logits1[0], logits[i])
        out = model.hf(torch.tensor([p]), use_cache=True)
        assert torch.allclose(logits[i], out.logits[0, -1], atol=1e-5, rtol=1e-5)
        past = out.past_key_values
        for layer in range(d.n_layer):   # HF's cache: (1, kv heads, positions, D), keys rotated
            hk, hv = past.layers[layer].keys[0], past.layers[layer].values[0]
            assert torch.allclose(kvs[i][layer, :d.n_kv], hk, atol=1e-5)
            assert torch.allclose(kvs[i][layer, d.n_kv:], hv, atol=1e-5)


@torch.inference_mode()
def test_a_cached_prefix_continues_to_the_same_bits_as_a_cold_prefill(llama):
    _, tok, d, _ = llama
    p = _prompts(tok, 1)[0]
    assert len(p) > 2 * BLOCK
    (kv,), logits = packed_prefill(d, [p], [None])
    for cut in (BLOCK, 2 * BLOCK, len(p) - 1):
        (kv2,), logits2 = packed_prefill(d, [p[cut:]], [kv[:, :, :cut].clone()])
        assert torch.equal(kv2, kv) and torch.equal(logits2, logits)


def test_the_prefix_cache_finds_whole_blocks_keeps_the_last_token_and_evicts_the_least_recent():
    def kv(n, fill):   # (layers, 2 KV, n, D) with each position's value its index plus `fill`
        return (torch.arange(n, dtype=torch.float32)[None, None, :, None] + fill).expand(2, 4, n, 3).contiguous()
    block_bytes = 2 * 4 * BLOCK * 3 * 4
    c = PrefixCache(max_bytes=4 * block_bytes)
    a = list(range(100, 100 + 3 * BLOCK + 5))
    assert c.lookup(a) is None
    c.store(a, kv(len(a), 0.0))
    assert c.bytes == 3 * block_bytes and len(c.blocks) == 3
    got = c.lookup(a)
    assert got.shape == (2, 4, 3 * BLOCK, 3) and torch.equal(got, kv(3 * BLOCK, 0.0))
    # a prompt of exactly 3 blocks: its last token is prefilled, so only 2 blocks come from the cache
    assert c.lookup(a[:3 * BLOCK]).size(2) == 2 * BLOCK
    # the same second block after a different first block is a different prefix
    b = [7] * BLOCK + a[BLOCK:]
    assert c.lookup(b) is None
    # a shares its first block with e: one new block; the budget (4 blocks) then evicts a's oldest use
    e = a[:BLOCK] + [9] * (BLOCK + 1)
    c.store(e, kv(len(e), 50.0))
    assert len(c.blocks) == 4 and c.bytes == 4 * block_bytes
    got = c.lookup(e)   # a's first block, then e's own second block (positions 16..31 of e's values)
    assert torch.equal(got[:, :, :BLOCK], kv(BLOCK, 0.0)) and torch.equal(got[:, :, BLOCK:], kv(BLOCK, 50.0 + BLOCK))
    f = [5] * (2 * BLOCK + 1)
    c.store(f, kv(len(f), 0.0))   # two new blocks: the two least recently used go (a's 2nd and 3rd)
    assert len(c.blocks) == 4 and c.bytes == 4 * block_bytes
    assert c.lookup(a).size(2) == BLOCK and c.lookup(f).size(2) == 2 * BLOCK


def test_a_batcher_with_the_prefix_cache_samples_the_same_tokens(llama):
    model, tok, d, _ = llama
    prompts = _prompts(tok, 8)
    for params in (SamplingParams(max_tokens=12, temperature=0.0),
                   SamplingParams(max_tokens=12, temperature=1.0, top_k=20, n=2, seed=3)):
        plain = staggered(model, tok, prompts, params, 6, d, prefix_cache=None)
        cache = PrefixCache(2**30)
        first = staggered(model, tok, prompts, params, 6, d, prefix_cache=cache)
        hits_first = cache.hits
        # every prompt's blocks are cached now
        again = staggered(model, tok, prompts, params, 6, d, prefix_cache=cache)
        assert first == plain and again == plain
        shared = len(tok.encode(SYSTEM)) // BLOCK * BLOCK
        assert hits_first >= (len(prompts) - 1) * shared > 0   # the system prompt, after the first prompt
        assert cache.hits - hits_first == sum((len(p) - 1) // BLOCK * BLOCK for p in prompts)


def _chunked_run(model, tok, d, prompts, params, chunk, cache=None):
    """Jobs submitted one per step to a batcher prefilling `chunk` tokens per step while rows decode (0: no
    limit); each job's tokens, and per step (the head job's prefilled positions, tokens of each running row)."""
    b = Batcher(model, tok, max_batch=8, context=512, decoder=d, prefix_cache=cache, prefill_chunk=chunk)
    jobs = [Job(p, params, draw=i) for i, p in enumerate(prompts)]
    trace, pending = [], list(jobs)
    while pending or not b.idle():
        if pending:
            b.submit(pending.pop(0))
        before = {(id(j), c.index): len(c.tokens) for j, c in b.rows if not c.done}
        b.step()
        head = b._head
        held = None if head is None or head.kv is None else (id(head), head.kv.size(2))
        after = {(id(j), c.index): len(c.tokens) for j, c in b.rows}
        trace.append((held, before, after))
    return [[c.tokens for c in j.choices] for j in jobs], trace


def test_long_prompts_prefill_in_chunks_while_rows_decode_and_sample_the_same_tokens(llama):
    model, tok, d, _ = llama
    long = [tok.encode(SYSTEM * 3 + q) for q in QUESTIONS[:5]]
    prompts = [tok.encode(QUESTIONS[5])] + [p for pair in zip(long, _prompts(tok, 5)) for p in pair]
    assert min(len(p) for p in long) > 3 * 32
    for params in (SamplingParams(max_tokens=24, temperature=0.0),
                   SamplingParams(max_tokens=24, temperature=1.0, top_k=20, n=2, seed=5)):
        whole, _ = _chunked_run(model, tok, d, prompts, params, 0)
        for chunk, cache in ((16, None), (32, None), (32, PrefixCache(2**30))):
            got, trace = _chunked_run(model, tok, d, prompts, params, chunk, cache)
            assert got == whole
            held = [h for h, _, _ in trace if h is not None]
            assert len({job for job, _ in held}) >= len(long)   # every long prompt waited part-prefilled
            assert all(n % BLOCK == 0 for _, n in held)   # chunks end on block boundaries
            # a job's prefix grows by one chunk per step at most (its first step may add cached blocks too)
            grew = [n2 - n1 for (j1, n1), (j2, n2) in zip(held, held[1:]) if j1 == j2]
            assert grew and max(grew) == chunk
            if cache is not None:
                assert cache.hits > 0
            for h, before, after in trace:
                if h is not None:   # while a prompt is part-prefilled, every running row still gets its token
                    assert all(after.get(k, n + 1) == n + 1 for k, n in before.items())


def _prefix_counts(url: str) -> dict[str, float]:
    lines = httpx.get(url + "/metrics").text.splitlines()
    return {k: float(v) for k, v in (line.split() for line in lines if line.startswith("grpolab:prefix_cache_"))}


def test_the_server_reuses_prefixes_and_says_so_in_metrics_with_an_off_switch(llama):
    *_, model_dir = llama
    body = {"model": str(model_dir), "prompt": SYSTEM + QUESTIONS[0], "max_tokens": 8, "temperature": 1.0, "seed": 4}
    texts = {}
    for args in ((), ("--prefix-cache-gib", "0")):
        with running_server(model_dir, *args) as (url, _):
            got = [httpx.post(url + "/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
                   for _ in range(2)]
            texts[args] = got
            counts = _prefix_counts(url)
        if args:
            assert counts == {}   # off: no cache, no counters
        else:
            n = counts["grpolab:prefix_cache_queries_total"] / 2   # the prompt's tokens, looked up twice
            assert counts["grpolab:prefix_cache_hits_total"] == (n - 1) // BLOCK * BLOCK > 0   # the second request's
    assert texts[()][0] == texts[()][1] == texts[("--prefix-cache-gib", "0")][0]


def test_rows_join_and_leave_the_lean_frame_without_copying_the_others(llama):
    model, tok, d, _ = llama
    prompts = _prompts(tok, 8)
    params = SamplingParams(max_tokens=10, temperature=1.0, top_k=20, seed=1)
    b = Batcher(model, tok, max_batch=4, context=512, decoder=d, prefix_cache=PrefixCache(2**30))
    jobs = [Job(p, params, draw=i) for i, p in enumerate(prompts)]
    frames, moved, pending = set(), 0, list(jobs)
    while pending or not b.idle():
        if pending:
            b.submit(pending.pop(0))
        before = [id(job) for job, _ in b.rows]
        b.step()
        if b.rows and b.cache.store is not None:   # rows the batch does not use are never read: poison them
            with torch.inference_mode():
                b.cache.store.kv[:, len(b.rows):] = float("nan")
        after = [id(job) for job, _ in b.rows]
        stayed = [r for r in after if r in before]
        moved += stayed != [r for r in before if r in stayed]   # a row took a leaver's place
        if set(after) - set(before) and before:   # rows joined a running batch: the store they were copied into
            frames.add(id(b.cache.store))
    assert frames and len(frames) < len(jobs) / 2   # joins copy into the store they find
    assert moved > 0                      # rows left by a move, not a copy of the batch
    for i, (p, job) in enumerate(zip(prompts, jobs)):   # each job alone, with no cache to share
        alone = Batcher(model, tok, max_batch=4, context=512, decoder=d)
        solo = Job(p, params, draw=i)
        alone.submit(solo)
        while not alone.idle():
            alone.step()
        assert [c.tokens for c in job.choices] == [c.tokens for c in solo.choices]


def test_the_frame_moves_within_its_store_and_columns_past_the_write_column_are_never_read(llama, monkeypatch):
    """Long prompts with short answers and short prompts with long ones through a batch of 3 rows: when the
    long rows have left, the next join moves the rows in their own store (LeanCache._shift), not into new
    tensors. After every step the store's rows not in use and every row's columns from the write column on
    are poisoned with NaN (a join leaves them unwritten); every job's tokens equal its solo run."""
    model, tok, d, _ = llama
    prompts = [p[:n] for p, n in zip(_prompts(tok, 8) * 2, [60, 9, 12, 55, 8, 10, 15, 9] * 2)]
    shifts = []
    real = LeanCache._shift
    monkeypatch.setattr(LeanCache, "_shift", lambda c, pos, k: shifts.append(pos) or real(c, pos, k))
    b = Batcher(model, tok, max_batch=3, context=512, decoder=d)
    jobs = [Job(p, SamplingParams(max_tokens=4 if len(p) > 50 else 20 + i % 7, temperature=1.0, seed=1), draw=i)
            for i, p in enumerate(prompts)]
    stores, pending = set(), list(jobs)
    while pending or not b.idle():
        if pending:
            b.submit(pending.pop(0))
        b.step()
        if b.rows and b.cache.store is not None:
            stores.add(id(b.cache.store))
            with torch.inference_mode():
                b.cache.store.kv[:, len(b.rows):] = float("nan")
                b.cache.kv[:, :, :, b.cache.pos:] = float("nan")
    assert shifts and len(stores) < len(shifts)   # moves reuse the store they find
    for i, (p, job) in enumerate(zip(prompts, jobs)):
        alone = Batcher(model, tok, max_batch=3, context=512, decoder=d)
        solo = Job(p, job.params, draw=i)
        alone.submit(solo)
        while not alone.idle():
            alone.step()
        assert [c.tokens for c in job.choices] == [c.tokens for c in solo.choices], i


def _rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def test_200_streamed_requests_with_cancellations_end_clean_and_equal_their_solo_runs(llama):
    """Random lengths, a quarter of the clients hanging up after their first chunk, 16 rows at a time (rows
    join, leave and move in the frame all the time), twice: no errors, the server idle and no bigger after
    the second wave than after the first, and every finished text the one its request gets alone."""
    *_, model_dir = llama
    rng = random.Random(0)
    reqs = [(i, SYSTEM + QUESTIONS[i % len(QUESTIONS)], rng.randint(1, 24), rng.random() < 0.25) for i in range(200)]

    def body(i, prompt, max_tokens, stream):
        return {"model": str(model_dir), "prompt": prompt, "max_tokens": max_tokens, "temperature": 1.0,
                "seed": i, "stream": stream}

    async def one(ac, url, i, prompt, max_tokens, hang_up):
        text = ""
        async with ac.stream("POST", url + "/v1/completions", json=body(i, prompt, max_tokens, True)) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                assert "error" not in chunk, chunk
                text += chunk["choices"][0]["text"]
                if hang_up:
                    return None
        return text

    async def wave(url):
        async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=256)) as ac:
            return await asyncio.gather(*(one(ac, url, *r) for r in reqs))

    with running_server(model_dir, "--max-batch", "16") as (url, proc):
        first = asyncio.run(wave(url))
        after_first = _rss_mib(proc.pid)
        second = asyncio.run(wave(url))
        after_second = _rss_mib(proc.pid)
        for _ in range(100):   # hung-up rows leave at the next step
            health = httpx.get(url + "/health").json()
            if health["running"] == 0:
                break
            time.sleep(0.05)
        assert health["running"] == 0 and health["waiting"] == 0
        finished = [(r, t) for r, t in zip(reqs, first) if t is not None]
        assert len(finished) > 120 and [t for t in second if t is not None] == [t for _, t in finished]
        for (i, prompt, max_tokens, _), text in finished:
            alone = httpx.post(url + "/v1/completions", json=body(i, prompt, max_tokens, False), timeout=60).json()
            assert alone["choices"][0]["text"] == text
    assert after_second <= after_first * 1.1 + 20
