"""grpolab on one NVIDIA GPU: rollout decode against transformers' `generate`, batch independence and
run-to-run exactness of the graph path, a GRPO step's split, two identical GRPO runs plus a resume,
TRL's GRPO step on the same card (where trl is importable), the decode kernels alone, where a
replayed decode step's time goes, and continuous refill (`refill`: a long-tailed rollout on fewer slots).

Random weights (timing and exactness do not need trained ones) in bfloat16, two model shapes:
  * smollm2: SmolLM2-135M-Instruct's own config.json (30 layers, GQA 9/3, tied head) and, for the GRPO
    runs, its real tokenizer and chat template (--assets: the folder with those small files);
  * qwen1.5b: Qwen2.5-1.5B's shape as a Llama config (28 layers, hidden 1536, GQA 12/2, MLP 8960,
    vocab 151,936, tied head).
Decode: 16 prompts of 128 random token ids x 8 samples, temperature 1, in two regimes: fixed (exactly
256 new tokens per row) and RL-like (row r stops at 16 + 240 u^3 tokens, the longest set to 256: our
engines through per-row budgets, HF's through a logits processor that forces the end token then). Three
engines alternate after a warm-up: `graph` (the slotted decode with CUDA graphs, rollout/slot_decode.py;
`graph64` the same with products of 64 rows),
`eager` (the pre-graph engine: rollout/decode_loop.py with the lean decode path) and `hf` (model.generate).
Tokens/s count the tokens each row keeps. `ms_per_step` is a fixed-length run's wall time over its 256
steps (prefill included); `floor_ms` is the memory-bandwidth floor of one step at the batch's mean
context (weights + the KV cache read once at the card's peak bandwidth), `of_floor` their ratio.

    python bench/gpu.py --out DIR [--assets DIR] [--sections env,kernels,invariance,decode,grpo,trl,profile,refill]
                        [--runs 2] [--shapes smollm2,qwen1.5b] [--regimes fixed,rl] [--engines graph,graph64,eager,hf]

One JSON object per line on stdout and in DIR/gpu.jsonl. Needs a CUDA device; never run by the tests.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from grpolab.models.hf import HFPolicy  # noqa: E402
from grpolab.rollout import slot_decode  # noqa: E402
from grpolab.rollout.engine import generate  # noqa: E402
from grpolab.rollout.keys import completion_keys  # noqa: E402

PEAK_BW = {"H200": 4.8e12, "H100 NVL": 3.9e12, "H100 PCIe": 2.0e12, "H100": 3.35e12, "A100": 2.0e12}
PROMPTS, SAMPLES, PROMPT_LEN, NEW = 16, 8, 128, 256
OUT: Path | None = None


def emit(rec: dict) -> None:
    line = json.dumps(rec)
    print(line, flush=True)
    if OUT is not None:
        with open(OUT / "gpu.jsonl", "a") as f:
            f.write(line + "\n")


def peak_bw() -> float:
    name = torch.cuda.get_device_name()
    return next((bw for k, bw in PEAK_BW.items() if k in name), 3.35e12)


def qwen_config():
    from transformers import LlamaConfig
    return LlamaConfig(vocab_size=151936, hidden_size=1536, num_hidden_layers=28, num_attention_heads=12,
                       num_key_value_heads=2, intermediate_size=8960, max_position_embeddings=32768,
                       rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=True, eos_token_id=151643,
                       bos_token_id=None, pad_token_id=None)


def smollm2_config(assets: Path):
    from transformers import AutoConfig
    return AutoConfig.from_pretrained(assets)


def random_model(cfg):
    from transformers import AutoModelForCausalLM
    torch.manual_seed(0)
    with torch.device("cuda"):
        m = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    return m.eval()


def timed(fn):
    torch.cuda.synchronize()
    t = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return out, time.perf_counter() - t


def rl_lengths(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    u = torch.rand(n, generator=g)
    L = (16 + (NEW - 16) * u ** 3).long()
    L[int(L.argmax())] = NEW
    return L


def ours(policy, prompts, lengths, eos, slots, new=NEW, rows_per_matmul=None):
    n = len(prompts)
    keys = completion_keys(0, torch.arange(n).repeat_interleave(SAMPLES), torch.arange(SAMPLES).repeat(n))
    kw = dict(num_generations=SAMPLES, max_new_tokens=new, temperature=1.0, stop_ids=(), pad_id=eos, keys=keys,
              budgets=lengths)
    if rows_per_matmul:   # the slotted decode at another product size
        g = slot_decode.generate(policy, prompts, top_k=0, top_p=1.0, rows_per_matmul=rows_per_matmul, **kw)
    else:
        g = generate(policy, prompts, slots=slots, **kw)
    return int(g.completion_mask.sum())


def hf_generate(model, prompts, lengths, eos, new=NEW):
    from transformers import LogitsProcessor, LogitsProcessorList

    ids = torch.tensor(prompts, device=model.device)
    P = ids.size(1)

    class Force(LogitsProcessor):   # row r: the end token impossible before lengths[r], certain at it
        def __init__(self):
            self.L = lengths.to(model.device) if lengths is not None else None

        def __call__(self, input_ids, scores):
            if self.L is None:
                scores[:, eos] = float("-inf")
                return scores
            t = input_ids.size(1) - P
            at = self.L - 1 == t
            scores[:, eos] = torch.where(self.L - 1 > t, float("-inf"), scores[:, eos])
            scores[at] = float("-inf")
            scores[at, eos] = 0.0
            return scores

    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=1.0, top_k=0,
                         top_p=1.0, max_new_tokens=new, num_return_sequences=SAMPLES,
                         logits_processor=LogitsProcessorList([Force()]), eos_token_id=eos, pad_token_id=eos)
    comp = out[:, P:]
    if lengths is None or new != NEW:
        return comp.numel()
    got = (((comp == eos).int().cumsum(-1) == 0).sum(-1) + 1).clamp(max=NEW)   # up to the first end token
    assert torch.equal(got.cpu(), lengths), "HF lengths differ from the forced ones"
    return int(lengths.sum())


def bytes_per_step(model, rows: int, mean_ctx: float) -> float:
    cfg = model.config
    weights = sum(p.numel() * p.element_size() for p in model.parameters())   # a tied head is counted once
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    kv = cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * head_dim * 2 * rows * mean_ctx
    return weights + kv


def decode_setup(shape: str, args):
    """A shape's random model, its policy, end token and the benchmark's random prompts."""
    cfg = smollm2_config(args.assets) if shape == "smollm2" else qwen_config()
    model = random_model(cfg)
    eos = model.config.eos_token_id
    eos = int(eos if isinstance(eos, int) else eos[0])
    g = torch.Generator().manual_seed(1)
    prompts = torch.randint(100, model.config.vocab_size - 1, (PROMPTS, PROMPT_LEN), generator=g).tolist()
    return model, HFPolicy(model), eos, prompts


def section_decode(args):
    for shape in args.shapes.split(","):
        model, policy, eos, prompts = decode_setup(shape, args)
        for regime in args.regimes.split(","):
            lengths = None if regime == "fixed" else rl_lengths(PROMPTS * SAMPLES)
            engines = {"graph": lambda: ours(policy, prompts, lengths, eos, True),
                       "eager": lambda: ours(policy, prompts, lengths, eos, False),
                       "hf": lambda: hf_generate(model, prompts, lengths, eos)}
            warm = {"graph": engines["graph"],   # the graph path captures per shape: warmed at the timed one
                    "eager": lambda: ours(policy, prompts, None, eos, False, new=8),
                    "hf": lambda: hf_generate(model, prompts, None, eos, new=8)}
            if shape == "smollm2":   # the same path with products of 64 rows (buckets of 64: 128, then 64)
                engines["graph64"] = warm["graph64"] = lambda: ours(policy, prompts, lengths, eos, True,
                                                                    rows_per_matmul=64)
            for k in [k for k in engines if k not in args.engines.split(",")]:
                del engines[k]
            for k in list(engines):   # warm-up (graph capture, Triton compile, cuBLAS handles)
                try:
                    warm[k]()
                except Exception as e:   # one engine's failure must not cost the others' figures
                    emit({"section": "decode", "shape": shape, "regime": regime, "engine": k,
                          "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-2000:]})
                    del engines[k]
            times = {k: [] for k in engines}
            toks, split = {}, {}
            for _ in range(args.runs):
                for k, fn in engines.items():
                    toks[k], s = timed(fn)
                    times[k].append(s)
                    if k.startswith("graph"):
                        split[k] = slot_decode.last_split(policy)
            rec = {"section": "decode", "shape": shape, "regime": regime, "rows": PROMPTS * SAMPLES,
                   "params_M": round(sum(p.numel() for p in model.parameters()) / 1e6, 1)}
            for k in engines:
                med = statistics.median(times[k])
                rec[f"{k}_tok_s"] = round(toks[k] / med)
                rec[f"{k}_s"] = round(med, 4)
            if regime == "fixed":
                floor = bytes_per_step(model, PROMPTS * SAMPLES, PROMPT_LEN + NEW / 2) / peak_bw() * 1e3
                rec["floor_ms"] = round(floor, 3)
                for k in engines:
                    ms = rec[f"{k}_s"] / NEW * 1e3
                    rec[f"{k}_ms_per_step"] = round(ms, 3)
                    rec[f"{k}_of_floor"] = round(floor / ms, 3)
            for k, x in split.items():   # where the graph path's time went (the last run)
                rec[f"{k}_prefill_s"] = round(x["prefill_s"], 4)
                rec[f"{k}_decode_ms_per_step"] = round(x["decode_s"] / x["steps"] * 1e3, 3)
            for other in ("hf", "eager", "graph64"):
                if "graph" in engines and other in engines:
                    rec[f"graph_over_{other}"] = round(rec["graph_tok_s"] / rec[f"{other}_tok_s"], 2)
            emit(rec)
        model = policy = engines = None   # freed before the next shape
        torch.cuda.empty_cache()


REFILL_PROMPTS, REFILL_NEW = 64, 1024


def section_refill(args):
    """Continuous refill: 64 prompts x 8 samples with RL-like lengths up to 1,024 tokens (16 + 1008 u^3), the
    slotted decode with every row in a slot at once against 128 slots refilled as rows finish (and, beside
    them, the same rows at a fixed 1,024 tokens); tokens/s, and whether the refilled completions equal the
    all-at-once ones."""
    for shape in args.shapes.split(","):
        model, policy, eos, _ = decode_setup(shape, args)
        g = torch.Generator().manual_seed(2)
        prompts = torch.randint(100, model.config.vocab_size - 1, (REFILL_PROMPTS, PROMPT_LEN), generator=g).tolist()
        n = REFILL_PROMPTS * SAMPLES
        u = torch.rand(n, generator=g)
        lengths = (16 + (REFILL_NEW - 16) * u ** 3).long()
        lengths[int(lengths.argmax())] = REFILL_NEW
        keys = completion_keys(0, torch.arange(REFILL_PROMPTS).repeat_interleave(SAMPLES),
                               torch.arange(SAMPLES).repeat(REFILL_PROMPTS))
        kw = dict(num_generations=SAMPLES, max_new_tokens=REFILL_NEW, temperature=1.0, top_k=0, top_p=1.0,
                  stop_ids=(), pad_id=eos, keys=keys)
        runs = {"all_rl": dict(budgets=lengths), "slots128_rl": dict(budgets=lengths, max_slots=128),
                "all_fixed": dict(budgets=None)}
        rec = {"section": "refill", "shape": shape, "rows": n, "mean_len": round(float(lengths.float().mean()), 1)}
        outs = {}
        for k, extra in runs.items():
            try:
                slot_decode.generate(policy, prompts, **kw, **extra)   # capture, at the timed shape
                times = []
                for _ in range(args.runs):
                    out, s = timed(lambda: slot_decode.generate(policy, prompts, **kw, **extra))
                    times.append(s)
                outs[k] = out
                med = statistics.median(times)
                rec[f"{k}_tok_s"] = round(int(out.completion_mask.sum()) / med)
                rec[f"{k}_s"] = round(med, 3)
                rec[f"{k}_steps"] = slot_decode.last_split(policy)["steps"]
            except Exception as e:   # one run's failure must not cost the others' figures
                rec[f"{k}_error"] = f"{type(e).__name__}: {e}"
                rec[f"{k}_traceback"] = traceback.format_exc()[-1500:]
        if "all_rl" in outs and "slots128_rl" in outs:
            a, b = outs["all_rl"], outs["slots128_rl"]
            rec["refill_same_completions"] = bool(torch.equal(a.completion_ids, b.completion_ids)
                                                  and torch.equal(a.sampler_logprobs, b.sampler_logprobs))
            rec["refill_speedup"] = round(rec["slots128_rl_tok_s"] / rec["all_rl_tok_s"], 2)
        emit(rec)
        model = policy = outs = None
        slot_decode._DECODERS.clear()
        torch.cuda.empty_cache()


def _kernel_table(prof, path: Path, steps: int) -> dict:
    """Per-step GPU kernel time by kernel name, from a profile's chrome trace (kernels inside graph replays
    included where CUPTI reports them)."""
    prof.export_chrome_trace(str(path))
    ev = [e for e in json.load(open(path))["traceEvents"] if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    if not ev:
        return {"kernels": 0}
    by: dict[str, list[float]] = {}
    for e in ev:
        by.setdefault(e["name"][:90], []).append(float(e["dur"]))
    span = (max(e["ts"] + e["dur"] for e in ev) - min(e["ts"] for e in ev)) / steps
    busy = sum(float(e["dur"]) for e in ev) / steps
    top = sorted(by.items(), key=lambda kv: -sum(kv[1]))[:30]
    return {"kernels_per_step": round(len(ev) / steps, 1), "busy_us_per_step": round(busy, 1),
            "span_us_per_step": round(span, 1),
            "top": [[k, len(v) // steps, round(sum(v) / steps, 1)] for k, v in top]}


def _events_ms(fn, n: int) -> float:
    """Mean milliseconds of `fn()` over n calls in a row, by CUDA events."""
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(n):
        fn()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / n


def section_profile(args):
    """Where a graph-path decode step's time goes: pure replay ms per step (CUDA events, no host looks),
    a prompt's prefill replay, and the kernels of a step by name (torch.profiler), at both product sizes."""
    from torch.profiler import ProfilerActivity, profile
    for shape in args.shapes.split(","):
        _, policy, eos, prompts = decode_setup(shape, args)
        for rpm in (64, 128):
            rec = {"section": "profile", "shape": shape, "rows_per_matmul": rpm}
            try:
                ours(policy, prompts, None, eos, True, rows_per_matmul=rpm)   # capture
                _, s = timed(lambda: ours(policy, prompts, None, eos, True, rows_per_matmul=rpm))
                split = slot_decode.last_split(policy)
                rec.update(run_s=round(s, 4), tok_s=round(PROMPTS * SAMPLES * NEW / s),
                           prefill_s=round(split["prefill_s"], 4),
                           decode_ms_per_step=round(split["decode_s"] / split["steps"] * 1e3, 3))
                dec = next(reversed(slot_decode._DECODERS[policy].values()))
                R = dec.shape.rows

                def restart() -> None:   # every row live at the prompt's length, the step counter at 0
                    dec.pos.zero_()
                    dec.cache.lens.fill_(PROMPT_LEN)

                with torch.inference_mode():
                    dec.done.fill_(False)
                    dec.budget.fill_(10 ** 6)
                    restart()
                    dec.graphs[R].replay()
                    restart()
                    rec["replay_ms_per_step"] = round(_events_ms(dec.graphs[R].replay, 64), 4)
                    pre = next(iter(dec.prefills.values()))
                    if pre.graph is not None:
                        rec["prefill_replay_ms"] = round(_events_ms(pre.graph.replay, 8), 4)
                    restart()
                    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                        for _ in range(4):
                            dec.graphs[R].replay()
                        torch.cuda.synchronize()
                    rec["graph"] = _kernel_table(prof, Path("/tmp") / f"trace_{shape}_{rpm}_graph.json", 4)
                    restart()
                    with slot_decode._nondeterministic_kernels_allowed():
                        dec._step(R)
                        torch.cuda.synchronize()
                        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                            for _ in range(2):
                                dec._step(R)
                            torch.cuda.synchronize()
                    rec["eager"] = _kernel_table(prof, Path("/tmp") / f"trace_{shape}_{rpm}_eager.json", 2)
            except Exception as e:
                rec.update(error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc()[-2000:])
            emit(rec)
            slot_decode._DECODERS.pop(policy, None)
            torch.cuda.empty_cache()


def section_kernels(args):
    """The decode's attention and the fused sampler alone, at the benchmark's rows and mean context: their
    time (triton.testing.do_bench, median) and their error against the torch computations they replace."""
    from triton.testing import do_bench

    from grpolab.models.decode_attention import decode_attention, reference
    from grpolab.rollout.keys import token_uniforms
    from grpolab.rollout.sampling import sample_next
    from grpolab.rollout.sampling_kernels import keyed_sample
    rows, ctx = PROMPTS * SAMPLES, PROMPT_LEN + NEW // 2
    for shape, H, KV, D, V in (("smollm2", 9, 3, 64, 49152), ("qwen1.5b", 12, 2, 128, 151936)):
        torch.manual_seed(0)
        q = torch.randn(rows, H, D, device="cuda").bfloat16()
        k, v = (torch.randn(rows, ctx + 128, KV, D, device="cuda").bfloat16() for _ in range(2))
        lens = torch.full((rows,), ctx, device="cuda")
        out, want = decode_attention(q, k, v, lens, D ** -0.5), reference(q, k, v, lens, D ** -0.5)
        logits = torch.randn(rows, V, device="cuda") * 4
        u = token_uniforms(torch.arange(rows, device="cuda") * 7919, 3)
        tok, lp = keyed_sample(logits, 1.0, u)
        tok2, lp2 = sample_next(logits, 1.0, 0, 1.0, None, u)
        emit({"section": "kernels", "shape": shape, "rows": rows, "context": ctx,
              "attention_us": round(do_bench(lambda: decode_attention(q, k, v, lens, D ** -0.5),
                                             return_mode="median") * 1e3, 1),
              "attention_rel_err": float((out.float() - want.float()).norm() / want.float().norm()),
              "kv_bytes_floor_us": round(2 * rows * ctx * KV * D * 2 / peak_bw() * 1e6, 1),
              "fused_sample_us": round(do_bench(lambda: keyed_sample(logits, 1.0, u), return_mode="median") * 1e3, 1),
              "sample_next_us": round(do_bench(lambda: sample_next(logits, 1.0, 0, 1.0, None, u),
                                               return_mode="median") * 1e3, 1),
              "sample_same_tokens": f"{int((tok == tok2).sum())}/{rows}",
              "sample_logprob_max_diff": float((lp - lp2).abs().max())})


def _gen(policy, prompts, G, keys, L, eos):
    return generate(policy, prompts, num_generations=G, max_new_tokens=L, temperature=1.0, stop_ids=(eos,),
                    pad_id=eos, keys=keys, slots=True)


def _rows_equal(a, i, b, j) -> bool:
    m, n = a.completion_mask[i], b.completion_mask[j]
    return (torch.equal(a.completion_ids[i][m], b.completion_ids[j][n])
            and torch.equal(a.sampler_logprobs[i][m], b.sampler_logprobs[j][n]))


def invariance(policy, vocab: int, eos: int, label: str, L: int = 96) -> dict:
    """Rows alone, in a smaller batch and in the full batch (graph path): the same tokens and log-probs."""
    g = torch.Generator().manual_seed(2)
    lens = torch.randint(8, 60, (PROMPTS,), generator=g).tolist()
    prompts = [torch.randint(3, vocab - 1, (n,), generator=g).tolist() for n in lens]
    keys = completion_keys(7, torch.arange(PROMPTS).repeat_interleave(SAMPLES),
                           torch.arange(SAMPLES).repeat(PROMPTS))
    full = _gen(policy, prompts, SAMPLES, keys, L, eos)
    again = _gen(policy, prompts, SAMPLES, keys, L, eos)
    rec = {"section": "invariance", "model": label, "rows": PROMPTS * SAMPLES,
           "repeat_equal": torch.equal(full.completion_ids, again.completion_ids)
           and torch.equal(full.sampler_logprobs, again.sampler_logprobs),
           "mean_len": round(float(full.completion_mask.sum(-1).float().mean()), 1)}
    alone = []
    n = PROMPTS * SAMPLES
    for r in sorted({0, 5 % n, (3 * n) // 5, n - 1}):
        one = _gen(policy, [prompts[r // SAMPLES]], 1, keys[r:r + 1], L, eos)
        alone.append(_rows_equal(one, 0, full, r))
    rec["alone_equal"] = alone
    sub = _gen(policy, prompts[1:3], SAMPLES, keys[SAMPLES:3 * SAMPLES], L, eos)
    rec["subset_equal"] = all(_rows_equal(sub, i, full, SAMPLES + i) for i in range(2 * SAMPLES))
    try:
        eager = generate(policy, prompts, num_generations=SAMPLES, max_new_tokens=L, temperature=1.0,
                         stop_ids=(eos,), pad_id=eos, keys=keys, slots=False)
        same = sum(torch.equal(e[m], f[n]) for e, m, f, n in zip(eager.completion_ids, eager.completion_mask,
                                                                  full.completion_ids, full.completion_mask))
        rec["rows_same_tokens_as_eager_path"] = f"{same}/{PROMPTS * SAMPLES}"
    except Exception as e:
        rec["eager_path_error"] = f"{type(e).__name__}: {e}"[:500]
    return rec


def section_invariance(args):
    from grpolab.models import GPT, GPTConfig
    model = random_model(smollm2_config(args.assets))
    eos = int(model.config.eos_token_id)
    emit(invariance(HFPolicy(model), model.config.vocab_size, eos, "smollm2_bf16"))
    del model
    torch.manual_seed(0)
    gpt = GPT(GPTConfig(vocab_size=300, n_layer=4, n_head=4, n_embd=128, block_size=256)).cuda().eval()
    emit(invariance(gpt, 300, 1, "builtin_gpt_fp32"))


def train(run_dir: Path, model_dir: Path, steps: int, extra: list[str] = ()) -> tuple[int, float, str]:
    cmd = [sys.executable, "-m", "grpolab.cli", "train", str(ROOT / "configs/demo.yaml"),
           f"model.name_or_path={model_dir}", "model.dtype=bfloat16", "model.device=cuda", "sft.steps=0",
           "data.task=arithmetic",
           "reward.functions=[length]", "rollout.prompts_per_step=16", "rollout.num_generations=8",
           "rollout.max_new_tokens=256", "eval.num_problems=16", "eval.k=2", "train.save_every=2",
           f"train.max_steps={steps}", f"train.output_dir={run_dir}", "log.level=quiet", *extra]
    t = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=600,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    return r.returncode, time.perf_counter() - t, (r.stderr or "")[-1500:]


def compare(a: Path, b: Path) -> tuple[int, str]:
    r = subprocess.run([sys.executable, str(ROOT / "scripts/compare_runs.py"), str(a), str(b)], capture_output=True,
                       text=True)
    return r.returncode, (r.stdout + r.stderr)[-800:]


def smollm2_dir(args) -> Path:
    """A SmolLM2-shaped model with random weights and SmolLM2's tokenizer, saved once for the runs."""
    from transformers import AutoTokenizer
    model_dir = OUT / "grpo" / "smollm2_random"
    if not (model_dir / "config.json").exists():
        model = random_model(smollm2_config(args.assets))
        model.save_pretrained(model_dir)
        AutoTokenizer.from_pretrained(args.assets).save_pretrained(model_dir)
        del model
        torch.cuda.empty_cache()
    return model_dir


def section_grpo(args):
    base = OUT / "grpo"
    model_dir = smollm2_dir(args)
    runs = {}
    names = args.grpo_runs.split(",")
    for name, steps in (x for x in (("a", 4), ("b", 4), ("c", 2)) if x[0] in names):
        runs[name] = train(base / name, model_dir, steps)
        rc, wall, err = runs[name]
        emit({"section": "grpo_run", "run": name, "steps": steps, "rc": rc, "wall_s": round(wall, 1),
              **({"stderr": err} if rc else {})})
    if "c" in names:
        rc, wall, err = train(base / "c", model_dir, 4, ["train.resume=auto"])
        emit({"section": "grpo_run", "run": "c_resumed", "steps": 4, "rc": rc, "wall_s": round(wall, 1),
              **({"stderr": err} if rc else {})})
    for x, y in (p for p in (("a", "b"), ("a", "c")) if p[1] in names):
        rc, text = compare(base / x, base / y)
        emit({"section": "grpo_exact", "pair": f"{x}-{y}", "identical": rc == 0, "detail": text})
    rows = [json.loads(line) for line in open(base / "a" / "metrics.jsonl") if '"time/step"' in line]
    split = {k: round(statistics.median(r[k] for r in rows[1:] or rows), 3)
             for k in ("time/step", "time/generate", "time/reward", "time/ref_and_advantages", "time/update")
             if k in rows[0]}
    emit({"section": "grpo_split", "steps": len(rows), "median_after_first": split,
          "reward_step1": rows[0].get("reward"), "tokens_step1": rows[0].get("completions/mean_length")})
    if args.nondeterministic:
        rc, wall, err = train(base / "nd", model_dir, 4, ["train.cuda_deterministic=false"])
        rows = [json.loads(line) for line in open(base / "nd" / "metrics.jsonl")
                if '"time/step"' in line] if rc == 0 else []
        emit({"section": "grpo_nondeterministic_kernels", "rc": rc, "median_step_after_first":
              round(statistics.median(r["time/step"] for r in rows[1:]), 3) if rows else None,
              **({"stderr": err} if rc else {})})


def section_trl(args):
    """TRL's GRPOTrainer on the same card, model and batch as section_grpo's run a: 16 arithmetic prompts
    (chat messages) x 8 completions of exactly 256 tokens (`min_new_tokens`, as bench/step.py forces it),
    bfloat16, beta 0, the clipped loss over all tokens (`dapo`, ours `token-mean`), lr 1e-4, the `length`
    reward, activation checkpointing off, generation by `model.generate` (no vLLM on that machine).
    Seconds per step (median of steps 2-4) and its generation's, beside ours from run a.
    Needs trl and datasets; a GPU machine without network gets them as wheels (docs/gpu.md)."""
    try:
        import trl
        from datasets import Dataset
        from datasets.table import InMemoryTable
        from transformers import TrainerCallback
        from trl import GRPOConfig
        from trl import GRPOTrainer as TRLGRPOTrainer
    except ImportError as e:
        emit({"section": "trl", "skipped": f"{type(e).__name__}: {e}"})
        return
    import dataclasses

    from grpolab.data.tasks import arithmetic
    from grpolab.rewards.length import length
    steps = 4
    rows = [{"prompt": [{"role": "user", "content": r["prompt"]}]}
            for r in arithmetic.generate("train", PROMPTS * steps, seed=0)]
    off = {f.name: False for f in dataclasses.fields(GRPOConfig)
           if f.name in ("gradient_checkpointing", "activation_checkpointing")}
    cfg = GRPOConfig(output_dir=str(OUT / "trl"), max_steps=steps, seed=0,
                     per_device_train_batch_size=PROMPTS * SAMPLES, gradient_accumulation_steps=1,
                     num_generations=SAMPLES, generation_batch_size=PROMPTS * SAMPLES, num_iterations=1,
                     shuffle_dataset=False, max_completion_length=NEW, generation_kwargs={"min_new_tokens": NEW},
                     temperature=1.0, top_p=1.0, top_k=0, beta=0.0, epsilon=0.2, loss_type="dapo",
                     learning_rate=1e-4, lr_scheduler_type="constant", warmup_steps=0, optim="adamw_torch",
                     max_grad_norm=1.0, model_init_kwargs={"dtype": "bfloat16"}, bf16=True, use_vllm=False,
                     report_to="none", logging_strategy="no", save_strategy="no", eval_strategy="no",
                     disable_tqdm=True, dataloader_num_workers=0, log_completions=False, **off)

    class Clock(TrainerCallback):
        def __init__(self) -> None:
            self.steps: list[float] = []
            self.tokens: list[int] = []
            self.t0 = 0.0

        def on_step_begin(self, a, state, control, **kw):
            torch.cuda.synchronize()
            self.t0 = time.perf_counter()

        def on_step_end(self, a, state, control, **kw):
            torch.cuda.synchronize()
            self.steps.append(time.perf_counter() - self.t0)
            self.tokens.append(int(sum(b["completion_mask"].sum() for b in trainer._buffered_inputs)))

    clock = Clock()
    # a fingerprint given, so that datasets does not hash the table with dill (which failed on that
    # machine's Python 3.12 with pyarrow 24: "Can't pickle <class 'MonthDayNano'>")
    dataset = Dataset(InMemoryTable.from_pylist(rows), fingerprint="bench-gpu-trl")
    trainer = TRLGRPOTrainer(model=str(smollm2_dir(args)), reward_funcs=[length], args=cfg,
                             train_dataset=dataset, callbacks=[clock])
    gen: list[float] = []
    inner = trainer._generate

    def timed_generate(*a, **kw):
        torch.cuda.synchronize()
        t = time.perf_counter()
        out = inner(*a, **kw)
        torch.cuda.synchronize()
        gen.append(time.perf_counter() - t)
        return out

    trainer._generate = timed_generate
    trainer.train()
    rec = {"section": "trl", "trl": trl.__version__, "steps": len(clock.steps),
           "completion_tokens_per_step": clock.tokens,
           "trl_step_s": round(statistics.median(clock.steps[1:]), 3),
           "trl_generate_s": round(statistics.median(gen[1:]), 3)}
    ours = OUT / "grpo" / "a" / "metrics.jsonl"
    if ours.exists():
        m = [json.loads(line) for line in open(ours) if '"time/step"' in line][1:]
        rec["ours_step_s"] = round(statistics.median(r["time/step"] for r in m), 3)
        rec["ours_generate_s"] = round(statistics.median(r["time/generate"] for r in m), 3)
        rec["trl_over_ours_step"] = round(rec["trl_step_s"] / rec["ours_step_s"], 2)
    emit(rec)


def main() -> None:
    global OUT
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--assets", type=Path, default=ROOT / "models" / "SmolLM2-135M-Instruct",
                   help="a folder with SmolLM2's config.json and tokenizer files")
    p.add_argument("--sections", default="env,kernels,invariance,decode,grpo,trl,profile")
    p.add_argument("--shapes", default="smollm2,qwen1.5b")
    p.add_argument("--runs", type=int, default=2)
    p.add_argument("--regimes", default="fixed,rl")
    p.add_argument("--engines", default="graph,graph64,eager,hf", help="the decode section's engines")
    p.add_argument("--grpo-runs", default="a,b,c", help="a and b: 4 steps each; c: 2 steps, then resumed to 4")
    p.add_argument("--nondeterministic", action="store_true", help="also a GRPO run without deterministic kernels")
    args = p.parse_args()
    OUT = args.out
    OUT.mkdir(parents=True, exist_ok=True)
    if not torch.cuda.is_available():
        sys.exit("bench/gpu.py needs a CUDA device")
    from grpolab.determinism import pin_cuda_numerics
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")   # before cuBLAS starts, as grpolab's jobs set it
    sections = {"invariance": section_invariance, "decode": section_decode, "grpo": section_grpo,
                "profile": section_profile, "kernels": section_kernels, "trl": section_trl, "refill": section_refill}
    for name in args.sections.split(","):
        t = time.perf_counter()
        try:
            if name == "env":
                import transformers
                try:
                    import triton
                    tv = triton.__version__
                except ImportError:
                    tv = None
                emit({"section": "env", "device": torch.cuda.get_device_name(), "torch": torch.__version__,
                      "transformers": transformers.__version__, "triton": tv, "peak_bw_TBps": peak_bw() / 1e12})
            else:
                # the invariance checks under the deterministic mode training runs use; the timings without
                # it, as users time engines (the slotted decode sets its own mode either way)
                if name == "invariance":
                    pin_cuda_numerics()
                else:
                    torch.use_deterministic_algorithms(False)
                sections[name](args)
        except Exception as e:   # one section's failure must not cost the others
            emit({"section": name, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]})
        emit({"section": name, "seconds": round(time.perf_counter() - t, 1)})


if __name__ == "__main__":
    main()
