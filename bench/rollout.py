"""Rollout throughput: our engine vs transformers' `generate` on the same model.

--shape tiny (default): a tiny Llama (hidden 128), 16 prompts x 4 samples x exactly 64 new tokens.
Also times the built-in GPT (ours only).

--shape realistic: a Llama of ~54M parameters (hidden 512, 8 layers, 8 heads, MLP 1024, vocab 32,000,
untied head) built locally with random weights; 8 prompts of 128 random token ids x 8 samples, in two
length regimes applied identically to both sides:
  * fixed: exactly 256 new tokens per row;
  * variable (RL-like): row r stops at a length L_r in [16, 256] drawn from a skewed distribution
    (16 + 240 u^3, u uniform, the longest row set to 256), forced the same way on both sides: a logits
    processor makes the end-of-sequence token impossible before L_r and certain at L_r (ours through
    `generate(logits_hook=...)`, HF's through `logits_processor`). Tokens/s count useful tokens, sum(L_r).
The lengths are checked on both outputs. Each figure is also stated against this machine's limits
(bench/roofline.py, measured in the same run): useful matmul FLOP/s over the decode-shape matmul
rate, and bytes of weights and KV cache read per second over the copy bandwidth.

--model smollm2 (or a model directory): a real pretrained model (SmolLM2-135M-Instruct, bench/_smollm2.py)
with its own tokenizer: the first --prompts held-out GSM8K-easy problems in its chat template (system
prompt included; prompts of different lengths, left-padded for HF) x 8 samples, at most --max-new new
tokens, in the same two regimes (variable: 16 + (max-16) u^3, the end-of-turn token forced as above);
and "variable_lora": the variable regime with LoRA r16 adapters on every block linear, the policy the
trainer samples from in bench/race.py --model (ours, then, cannot use its lean decode path: see the
`path` field), against HF `generate` on the same peft model.

All runs: temperature 1.0, fp32, CPU, 2 threads (--threads: the same number on both sides); runs alternate
(ours, HF, ours, HF, ...) after a warm-up; the medians and their ratio are printed as one JSON line.

    python bench/rollout.py [--runs 5] [--shape tiny|realistic]
    python bench/rollout.py --model smollm2 [--runs 3] [--prompts 4] [--max-new 128] [--threads 2]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import sys
import tempfile
import time

import torch

from grpolab.data.tasks import arithmetic
from grpolab.models import GPT, CharTokenizer, GPTConfig
from grpolab.models.hf import load_hf
from grpolab.models.tiny_hf import save_tiny_model
from grpolab.rollout.engine import generate

PROMPTS, SAMPLES, NEW = 16, 4, 64


def ours(model, prompts, pad_id, seed):
    g = torch.Generator().manual_seed(seed)
    t = time.perf_counter()
    out = generate(model, prompts, num_generations=SAMPLES, max_new_tokens=NEW, temperature=1.0,
                   stop_ids=(), pad_id=pad_id, generator=g)   # no stop ids: exactly NEW tokens
    dt = time.perf_counter() - t
    assert out.completion_ids.shape == (PROMPTS * SAMPLES, NEW)
    return PROMPTS * SAMPLES * NEW / dt


def hf(model, prompts, pad_id, seed):
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    torch.manual_seed(seed)
    t = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=mask, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                             max_new_tokens=NEW, min_new_tokens=NEW, num_return_sequences=SAMPLES,
                             pad_token_id=pad_id, eos_token_id=None)
    dt = time.perf_counter() - t
    assert out.shape[1] - width == NEW
    return PROMPTS * SAMPLES * NEW / dt


# ---- the realistic shape -----------------------------------------------------------------------------
R_PROMPTS, R_SAMPLES, R_PROMPT_LEN, R_NEW, EOS = 8, 8, 128, 256, 2
R_HIDDEN, R_LAYERS, R_HEADS, R_MLP, R_VOCAB = 512, 8, 8, 1024, 32_000


def realistic_model():
    from transformers import LlamaConfig, LlamaForCausalLM

    from grpolab.models.hf import HFPolicy
    cfg = LlamaConfig(vocab_size=R_VOCAB, hidden_size=R_HIDDEN, num_hidden_layers=R_LAYERS,
                      num_attention_heads=R_HEADS, num_key_value_heads=R_HEADS, intermediate_size=R_MLP,
                      max_position_embeddings=512, tie_word_embeddings=False, eos_token_id=EOS, pad_token_id=0,
                      bos_token_id=1)
    torch.manual_seed(0)
    return HFPolicy(LlamaForCausalLM(cfg).eval())


def rl_lengths(rows: int, max_new: int) -> torch.Tensor:
    """RL-like completion lengths: 16 + (max_new - 16) u^3, u uniform (seeded), the longest set to max_new."""
    g = torch.Generator().manual_seed(0)
    u = torch.rand(rows, generator=g)
    lengths = (16 + (max_new - 16) * u ** 3).long()
    lengths[lengths.argmax()] = max_new   # a few rows run to the cap
    return lengths


def force_lengths(logits: torch.Tensor, t: int, rows: torch.Tensor, lengths: torch.Tensor,
                  eos: int = EOS) -> torch.Tensor:
    """EOS impossible before a row's length, certain at it (token t is the (t+1)-th)."""
    logits[:, eos] = float("-inf")
    at = lengths[rows.to(lengths.device)] == t + 1
    if bool(at.any()):
        logits[at] = float("-inf")
        logits[at, eos] = 0.0
    return logits


def r_ours(policy, prompts, seed, lengths=None) -> tuple[float, int]:
    g = torch.Generator().manual_seed(seed)
    hook = None if lengths is None else (lambda lg, t, rows: force_lengths(lg, t, rows, lengths))
    t = time.perf_counter()
    out = generate(policy, prompts, num_generations=R_SAMPLES, max_new_tokens=R_NEW, temperature=1.0,
                   stop_ids=() if lengths is None else (EOS,), pad_id=0, generator=g, logits_hook=hook)
    dt = time.perf_counter() - t
    got = out.completion_mask.sum(-1)
    want = lengths if lengths is not None else torch.full_like(got, R_NEW)
    assert torch.equal(got, want), "ours: completion lengths differ from the forced ones"
    return dt, int(want.sum())


def r_hf(policy, prompts, seed, lengths=None) -> tuple[float, int]:
    from transformers import LogitsProcessor, LogitsProcessorList

    class Force(LogitsProcessor):
        def __call__(self, input_ids, scores):
            rows = torch.arange(scores.size(0))
            return force_lengths(scores, input_ids.size(1) - R_PROMPT_LEN, rows, lengths)
    ids = torch.tensor(prompts)
    torch.manual_seed(seed)
    extra = ({"min_new_tokens": R_NEW, "eos_token_id": None} if lengths is None else
             {"eos_token_id": EOS, "logits_processor": LogitsProcessorList([Force()])})
    t = time.perf_counter()
    with torch.inference_mode():
        out = policy.hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=1.0,
                                 top_k=0, top_p=1.0, max_new_tokens=R_NEW, num_return_sequences=R_SAMPLES,
                                 pad_token_id=0, **extra)
    dt = time.perf_counter() - t
    gen = out[:, R_PROMPT_LEN:]
    if lengths is None:
        assert gen.size(1) == R_NEW
        return dt, gen.numel()
    first_eos = (gen == EOS).long().argmax(-1) + 1
    assert torch.equal(first_eos, lengths), "HF: completion lengths differ from the forced ones"
    return dt, int(lengths.sum())


def realistic(runs: int) -> dict:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import roofline

    policy = realistic_model()
    g = torch.Generator().manual_seed(1)
    prompts = torch.randint(3, R_VOCAB, (R_PROMPTS, R_PROMPT_LEN), generator=g).tolist()
    lengths = rl_lengths(R_PROMPTS * R_SAMPLES, R_NEW)
    limits = roofline.measure()
    params = sum(p.numel() for n, p in policy.named_parameters() if "embed_tokens" not in n)
    result = {"bench": "rollout", "shape": "realistic", "params": sum(p.numel() for p in policy.parameters()),
              "prompts": R_PROMPTS, "samples": R_SAMPLES, "prompt_len": R_PROMPT_LEN, "max_new": R_NEW,
              "runs": runs, "limits": limits}
    for regime, lens in (("fixed", None), ("variable", lengths)):
        r_ours(policy, prompts, 0, lens), r_hf(policy, prompts, 0, lens)   # warm-up
        a, b = [], []
        for i in range(runs):
            a.append(r_ours(policy, prompts, i + 1, lens))
            b.append(r_hf(policy, prompts, i + 1, lens))
        ours_s, hf_s = statistics.median(x[0] for x in a), statistics.median(x[0] for x in b)
        useful = a[0][1]
        lens_f = lens.double() if lens is not None else torch.full((R_PROMPTS * R_SAMPLES,), float(R_NEW))
        # useful matmul FLOPs: 2 x non-embedding weights per token, plus attention's QK and AV over the context
        attn = float((4 * R_LAYERS * R_HIDDEN * (R_PROMPT_LEN + (lens_f + 1) / 2) * lens_f).sum())
        flops = 2 * params * useful + attn
        # bytes read by a decode that drops finished rows: per step the weights, per row-step its KV so far
        kv = float((2 * R_LAYERS * R_HIDDEN * 4 * (R_PROMPT_LEN + (lens_f + 1) / 2) * lens_f).sum())
        steps = int(lens_f.max())
        bytes_read = steps * params * 4 + kv
        result[regime] = {
            "useful_tokens": useful, "ours_tok_s": round(useful / ours_s, 1),
            "hf_generate_tok_s": round(useful / hf_s, 1), "ratio_ours_over_hf": round(hf_s / ours_s, 2),
            "ours_fraction_of_matmul_limit": round(flops / ours_s / 1e9 / limits["decode_matmul_gflops"], 3),
            "ours_fraction_of_bandwidth": round(bytes_read / ours_s / 1e9 / limits["copy_bandwidth_gbs"], 3),
            "ours_s": [round(x[0], 3) for x in a], "hf_s": [round(x[0], 3) for x in b]}
    return result


# ---- a real model (--model) ---------------------------------------------------------------------------

def m_ours(policy, prompts, samples, max_new, eos, pad, seed, lengths=None) -> float:
    g = torch.Generator().manual_seed(seed)
    hook = None if lengths is None else (lambda lg, t, rows: force_lengths(lg, t, rows, lengths, eos))
    t = time.perf_counter()
    out = generate(policy, prompts, num_generations=samples, max_new_tokens=max_new, temperature=1.0,
                   stop_ids=() if lengths is None else (eos,), pad_id=pad, generator=g, logits_hook=hook)
    dt = time.perf_counter() - t
    got = out.completion_mask.sum(-1)
    want = lengths if lengths is not None else torch.full_like(got, max_new)
    assert torch.equal(got, want), "ours: completion lengths differ from the forced ones"
    return dt


def m_hf(hf_model, prompts, samples, max_new, eos, pad, seed, lengths=None) -> float:
    from transformers import LogitsProcessor, LogitsProcessorList
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])

    class Force(LogitsProcessor):
        def __call__(self, input_ids, scores):
            return force_lengths(scores, input_ids.size(1) - width, torch.arange(scores.size(0)), lengths, eos)
    extra = ({"min_new_tokens": max_new, "eos_token_id": None} if lengths is None else
             {"eos_token_id": eos, "logits_processor": LogitsProcessorList([Force()])})
    torch.manual_seed(seed)
    t = time.perf_counter()
    with torch.inference_mode():
        out = hf_model.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0, top_k=0,
                                top_p=1.0, max_new_tokens=max_new, num_return_sequences=samples, pad_token_id=pad,
                                **extra)
    dt = time.perf_counter() - t
    gen = out[:, width:]
    if lengths is None:
        assert gen.size(1) == max_new
    else:
        first_eos = (gen == eos).long().argmax(-1) + 1
        assert torch.equal(first_eos, lengths), "HF: completion lengths differ from the forced ones"
    return dt


def real_model(model_arg: str, runs: int, n_prompts: int, max_new: int, samples: int = 8) -> dict:
    """Our engine vs HF generate on a real model and its chat prompts (see the module docstring)."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import _smollm2 as sm
    import transformers

    from grpolab.models.lean_decode import unsupported_reason
    from grpolab.models.lora import add_lora
    model = sm.resolve_model(model_arg)
    s = sm.Setting(max_new=max_new)
    policy, tok = load_hf(str(model))
    prompts = [tok.render_prompt(r["prompt"]) for r in sm.eval_rows(n_prompts, model, s)]
    lengths = rl_lengths(n_prompts * samples, max_new)
    lora = copy.deepcopy(policy)
    add_lora(lora, {"r": s.lora_r, "lora_alpha": s.lora_alpha, "lora_dropout": 0.0,
                    "target_modules": list(sm.LORA_TARGETS)})
    lora.hf.eval()
    result = {"bench": "rollout", "model": str(model), "params": sum(p.numel() for p in policy.parameters()),
              "prompts": n_prompts, "samples": samples, "prompt_tokens": [len(p) for p in prompts],
              "max_new": max_new, "runs": runs, "eos": tok.eos_id}
    load0 = os.getloadavg()[0]
    regimes = (("fixed", policy, None), ("variable", policy, lengths), ("variable_lora", lora, lengths))
    for regime, pol, lens in regimes:
        args = (prompts, samples, max_new, tok.eos_id, tok.pad_id)
        m_ours(pol, *args, 0, lens), m_hf(pol.hf, *args, 0, lens)   # warm-up
        a, b = [], []
        for i in range(runs):
            a.append(m_ours(pol, *args, i + 1, lens))
            b.append(m_hf(pol.hf, *args, i + 1, lens))
        useful = int(lens.sum()) if lens is not None else n_prompts * samples * max_new
        ours_s, hf_s = statistics.median(a), statistics.median(b)
        why = unsupported_reason(pol.hf, max(len(p) for p in prompts) + max_new)
        result[regime] = {"useful_tokens": useful, "ours_tok_s": round(useful / ours_s, 1),
                          "hf_generate_tok_s": round(useful / hf_s, 1), "ratio_ours_over_hf": round(hf_s / ours_s, 2),
                          # the fastest run of each: the least disturbed by other load on a shared machine
                          "ratio_best_ours_over_best_hf": round(min(b) / min(a), 2),
                          "path": "lean decode" if why is None else f"model forward + DynamicCache ({why})",
                          "ours_s": [round(x, 2) for x in a], "hf_s": [round(x, 2) for x in b]}
        print(f"{regime}: {result[regime]}", file=sys.stderr, flush=True)
    result.update({"loadavg_1m_start_end": [round(load0, 2), round(os.getloadavg()[0], 2)],
                   "machine": f"{platform.machine()}, {os.cpu_count()} cores", "threads": torch.get_num_threads(),
                   "transformers": transformers.__version__})
    return result


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--shape", choices=["tiny", "realistic"], default="tiny")
    ap.add_argument("--model", help="a real model: 'smollm2' or a model directory (see above)")
    ap.add_argument("--prompts", type=int, default=4, help="--model: held-out prompts (x 8 samples)")
    ap.add_argument("--max-new", type=int, default=128, help="--model: new tokens at most (>= 17)")
    ap.add_argument("--threads", type=int, default=2, help="torch threads, both sides (1: steadier where other "
                    "jobs oversubscribe the cores, as a 2-thread decode then waits at every op's barrier)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.model:
        if args.prompts < 1 or args.max_new < 17 or args.runs < 1:
            ap.error("--prompts and --runs must be >= 1, --max-new >= 17")
        print(json.dumps({**real_model(args.model, args.runs, args.prompts, args.max_new), "torch": torch.__version__}))
        return
    if args.shape == "realistic":
        print(json.dumps({**realistic(args.runs), "torch": torch.__version__}))
        return
    rows = arithmetic.generate("test", PROMPTS, seed=0)
    with tempfile.TemporaryDirectory() as d:
        save_tiny_model(d, vocab_size=512, hidden=128, layers=4, heads=4, intermediate=512)
        policy, tok = load_hf(d)
    prompts = [tok.render_prompt(r["prompt"]) for r in rows]
    a, b = [], []
    ours(policy, prompts, tok.pad_id, 0), hf(policy.hf, prompts, tok.pad_id, 0)   # warm-up
    for i in range(args.runs):
        a.append(ours(policy, prompts, tok.pad_id, i + 1))
        b.append(hf(policy.hf, prompts, tok.pad_id, i + 1))
    ctok = CharTokenizer()
    torch.manual_seed(0)
    gpt = GPT(GPTConfig(vocab_size=ctok.vocab_size, n_layer=4, n_head=4, n_embd=128, block_size=160)).eval()
    cprompts = [ctok.render_prompt(r["prompt"]) for r in rows]
    ours(gpt, cprompts, ctok.pad_id, 0)
    c = [ours(gpt, cprompts, ctok.pad_id, i + 1) for i in range(args.runs)]
    print(json.dumps({
        "bench": "rollout", "prompts": PROMPTS, "samples": SAMPLES, "new_tokens": NEW, "runs": args.runs,
        "tiny_llama_ours_tok_s": round(statistics.median(a)),
        "tiny_llama_hf_generate_tok_s": round(statistics.median(b)),
        "ratio_ours_over_hf": round(statistics.median(a) / statistics.median(b), 2),
        "builtin_gpt_ours_tok_s": round(statistics.median(c)), "torch": torch.__version__}))


if __name__ == "__main__":
    main()
