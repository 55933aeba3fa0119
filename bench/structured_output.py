"""Constrained decoding on a CPU: what each candidate library costs per generated token.

    .venv/bin/python bench/structured_output.py [--model models/SmolLM2-135M-Instruct] [--reps 20]

For llguidance, xgrammar and outlines-core (the three vLLM 0.32 depends on), on SmolLM2's tokenizer
(49,152 tokens) and one JSON schema (nested object, array, enum, integer bounds, a string pattern):

  tokenizer_s  building the library's view of the vocabulary (once per server)
  compile_s    compiling the schema against it (once per distinct schema; the first request pays it)
  mask_us      the library's mask computation alone (mean, p99), in the same walks
  first_walk_ms the first walk through a JSON instance of the schema (65 tokens), fresh after compiling
  per_token_us one decode step as the server does it: compute the allowed-token mask (the library),
               apply it to a (1, V) float32 logits row (the same torch code for all three:
               grpolab.rollout.logits_processors), accept the chosen token (mean, p50, p99, max over every token of
               the `--reps` - 1 later walks, each with a fresh matcher; the same token ids for all three)

With --e2e, also the server's engine on SmolLM2 itself (grpolab.serve.batcher, 2 threads): milliseconds
per decode step of 8 rows x 48 tokens (a chat prompt, temperature 1, seeded), whole and in the logits
processors alone, plain, with the three penalties, with json_object and with the JSON schema, alternating
modes over `--rounds` (medians).

Prints one JSON line per library (and per e2e mode) and writes them all to bench/results/structured_output.json.
Single-threaded mask computation on whatever CPU runs it; compare numbers from the same run.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch
from transformers import AutoTokenizer

from grpolab.rollout.logits_processors import allow_only, unpack_bitmask

ROOT = Path(__file__).resolve().parents[1]
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string", "pattern": "^[a-z]+@[a-z]+\\.(com|org)$"},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
        "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                    "required": ["city", "zip"], "additionalProperties": False},
    },
    "required": ["name", "age", "email", "role", "tags", "address"],
    "additionalProperties": False,
}
INSTANCE = {"name": "Ada Lovelace", "age": 36, "email": "ada@engines.org", "role": "admin",
            "tags": ["math", "poetry", "engines"], "address": {"city": "London", "zip": "W1"}}


def _walk(step, ids: list[int], reps: int, new) -> tuple[list[list[float]], list[float]]:
    """Seconds per token of each of `reps` walks through `ids`, each with a fresh matcher from `new()`;
    and the seconds of the mask computation alone (`step` returns them) in the walks after the first."""
    walks, masks = [], []
    for r in range(reps):
        state, times = new(), []
        for t in ids:
            t0 = time.perf_counter()
            m = step(state, t)
            times.append(time.perf_counter() - t0)
            if r:
                masks.append(m)
        walks.append(times)
    return walks, masks


def bench_llguidance(hf, V: int, ids: list[int], reps: int) -> dict:
    import llguidance
    import llguidance.hf
    import llguidance.torch as lt

    t0 = time.perf_counter()
    lltok = llguidance.hf.from_tokenizer(hf, n_vocab=V)
    t1 = time.perf_counter()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA))
    m = llguidance.LLMatcher(lltok, grammar)
    assert not m.is_error(), m.get_error()
    t2 = time.perf_counter()
    mask = lt.allocate_token_bitmask(1, V)
    logits = torch.zeros(1, V)

    def step(m, t):
        t0 = time.perf_counter()
        lt.fill_next_token_bitmask(m, mask, 0)
        took = time.perf_counter() - t0
        allow_only(logits, unpack_bitmask(mask, V))
        assert m.consume_token(t), m.get_error()
        return took

    times = _walk(step, ids, reps, lambda: llguidance.LLMatcher(lltok, grammar))
    return {"version": llguidance.__version__ if hasattr(llguidance, "__version__") else _version("llguidance"),
            "tokenizer_s": t1 - t0, "compile_s": t2 - t1, **_stats(*times)}


def bench_xgrammar(hf, V: int, ids: list[int], reps: int) -> dict:
    import xgrammar as xgr

    t0 = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=V)
    compiler = xgr.GrammarCompiler(info, max_threads=1)
    t1 = time.perf_counter()
    compiled = compiler.compile_json_schema(json.dumps(SCHEMA))
    t2 = time.perf_counter()
    mask = xgr.allocate_token_bitmask(1, V)
    logits = torch.zeros(1, V)

    def step(m, t):
        t0 = time.perf_counter()
        m.fill_next_token_bitmask(mask)
        took = time.perf_counter() - t0
        allow_only(logits, unpack_bitmask(mask, V))
        assert m.accept_token(t)
        return took

    times = _walk(step, ids, reps, lambda: xgr.GrammarMatcher(compiled))
    return {"version": xgr.__version__ if hasattr(xgr, "__version__") else _version("xgrammar"),
            "tokenizer_s": t1 - t0, "compile_s": t2 - t1, **_stats(*times)}


def bench_outlines_core(hf, V: int, ids: list[int], reps: int) -> dict:
    import outlines_core as oc

    t0 = time.perf_counter()
    # token id -> its bytes, as vLLM builds outlines' vocabulary (byte-level BPE: GPT-2's byte alphabet)
    from transformers.convert_slow_tokenizer import bytes_to_unicode
    to_byte = {v: k for k, v in bytes_to_unicode().items()}
    vocab: dict[bytes, list[int]] = {}
    special = set(hf.all_special_tokens)
    for token, i in hf.get_vocab().items():
        if token not in special:
            vocab.setdefault(bytes(to_byte[c] for c in token), []).append(i)
    vocabulary = oc.Vocabulary(hf.eos_token_id, vocab)
    t1 = time.perf_counter()
    regex = oc.json_schema.build_regex_from_schema(json.dumps(SCHEMA))
    index = oc.Index(regex, vocabulary)
    t2 = time.perf_counter()
    mask = torch.zeros(1, (V + 31) // 32, dtype=torch.int32)
    logits = torch.zeros(1, V)

    def step(g, t):
        t0 = time.perf_counter()
        g.write_mask_into(mask.data_ptr(), mask.numel(), mask.element_size())
        took = time.perf_counter() - t0
        allow_only(logits, unpack_bitmask(mask, V))
        g.advance(t)
        return took

    times = _walk(step, ids, reps, lambda: oc.Guide(index))
    return {"version": _version("outlines_core"), "tokenizer_s": t1 - t0, "compile_s": t2 - t1,
            "regex_chars": len(regex), **_stats(*times)}


def _version(dist: str) -> str:
    from importlib.metadata import version
    return version(dist)


def _stats(walks: list[list[float]], masks: list[float]) -> dict:
    """The first walk apart (a library may build parts of its automaton lazily, on first use), then the rest."""
    us = sorted(t * 1e6 for w in walks[1:] for t in w)
    return {"first_walk_ms": sum(walks[0]) * 1e3, "first_walk_max_token_ms": max(walks[0]) * 1e3,
            "tokens": len(us), "per_token_us_mean": statistics.fmean(us), "per_token_us_p50": us[len(us) // 2],
            "per_token_us_p99": us[int(len(us) * 0.99)], "per_token_us_max": us[-1],
            "mask_us_mean": statistics.fmean(masks) * 1e6, "mask_us_p99": sorted(masks)[int(len(masks) * 0.99)] * 1e6}


def e2e(model: str, rounds: int) -> list[dict]:
    """Per decode step: the whole step and the logits processors alone (Batcher._processed: penalties,
    bias, the grammar's masks), medians over the rounds."""
    from grpolab.rollout.structured import Constraint
    from grpolab.serve.batcher import Job, SamplingParams
    from grpolab.serve.model_loader import load_engine

    torch.set_num_threads(2)
    batcher, tok, _ = load_engine(model, max_batch=8)
    spent = [0.0]
    processed = batcher._processed

    def timed():   # the processors' share of each step, measured inside the real decode
        t0 = time.perf_counter()
        out = processed()
        spent[0] += time.perf_counter() - t0
        return out

    batcher._processed = timed
    ids = tok.render_prompt([{"role": "user", "content": "Describe a person as JSON with a name and an age."}])
    base = dict(max_tokens=48, temperature=1.0, n=8, seed=0)
    modes = {"plain": {}, "penalties": dict(presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.2),
             "json_object": dict(constraint=Constraint("json_object")),
             "json_schema": dict(constraint=Constraint("json", json.dumps(SCHEMA)))}
    runs: dict[str, list[tuple[float, float]]] = {m: [] for m in modes}
    for r in range(rounds + 1):   # round 0 warms up (and builds llguidance's vocabulary)
        for name, extra in modes.items():
            job = Job(ids, SamplingParams(**base, **extra))
            steps0, spent[0] = batcher.steps, 0.0
            t0 = time.perf_counter()
            batcher.submit(job)
            while not batcher.idle():
                batcher.step()
            steps = batcher.steps - steps0
            if r:
                runs[name].append(((time.perf_counter() - t0) / steps, spent[0] / steps))
    return [{"e2e": name, "step_ms_median": statistics.median(a for a, _ in v) * 1e3,
             "processors_ms_median": statistics.median(b for _, b in v) * 1e3, "rows": 8, "threads": 2}
            for name, v in runs.items()]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=str(ROOT / "models" / "SmolLM2-135M-Instruct"))
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--e2e", action="store_true", help="also time the server's engine on --model")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--only-e2e", action="store_true", help="skip the three libraries (the e2e part only)")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "structured_output.json"))
    a = p.parse_args()
    torch.set_num_threads(1)
    hf = AutoTokenizer.from_pretrained(a.model)
    V = len(hf)
    ids = hf(json.dumps(INSTANCE), add_special_tokens=False)["input_ids"]
    results = []
    libraries = () if a.only_e2e else (("llguidance", bench_llguidance), ("xgrammar", bench_xgrammar),
                                       ("outlines_core", bench_outlines_core))
    for name, fn in libraries:
        try:
            r = {"library": name, **fn(hf, V, ids, a.reps)}
        except Exception as e:   # one library failing is itself a result
            r = {"library": name, "error": f"{type(e).__name__}: {e}"}
        r.update(vocab=V, instance_tokens=len(ids), cpu=platform.processor() or platform.machine(), torch_threads=1)
        print(json.dumps(r), flush=True)
        results.append(r)
    if a.e2e or a.only_e2e:
        for r in e2e(a.model, a.rounds):
            print(json.dumps(r), flush=True)
            results.append(r)
    Path(a.out).write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
