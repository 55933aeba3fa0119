"""Evaluation on held-out problems: greedy accuracy, pass@k (unbiased), maj@k."""

from __future__ import annotations

from collections import Counter
from math import comb

import torch

from .rewards.answers import extract_hash_answer, gsm8k_accuracy, reference_answer
from .rollout.engine import generate


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k (Chen et al. 2021): 1 - C(n-c, k) / C(n, k), for n samples with c correct."""
    if k > n:
        raise ValueError(f"pass@{k} needs at least {k} samples, got {n}")
    if n - c < k:
        return 1.0
    return 1.0 - comb(n - c, k) / comb(n, k)


def _decode(tokenizer, gen) -> list[str]:
    return [tokenizer.decode(ids[m].tolist()) for ids, m in zip(gen.completion_ids, gen.completion_mask)]


def _chunks(seq: list, size: int):
    for i in range(0, len(seq), size):
        yield seq[i:i + size]


def evaluate(model, tokenizer, rows: list[dict], *, k: int = 8, temperature: float = 1.0,
             max_new_tokens: int = 32, batch_size: int = 512, seed: int = 0) -> dict:
    """Greedy accuracy and, with k > 1 samples at `temperature`, pass@1..k and maj@k.

    Returns a metrics dict plus 'samples': one record per problem.
    """
    prompts = [tokenizer.render_prompt(r["prompt"]) for r in rows]
    answers = [r["answer"] for r in rows]
    stop = (tokenizer.eos_id,)
    greedy: list[str] = []
    for chunk in _chunks(prompts, batch_size):
        greedy += _decode(tokenizer, generate(model, chunk, num_generations=1, max_new_tokens=max_new_tokens,
                                              temperature=0.0, stop_ids=stop, pad_id=tokenizer.pad_id))
    greedy_ok = gsm8k_accuracy(None, greedy, answers)
    out = {"greedy_accuracy": sum(greedy_ok) / len(rows)}
    samples: list[str] = []
    if k > 1:
        gen = torch.Generator().manual_seed(seed)
        per = max(1, batch_size // k)
        for chunk in _chunks(prompts, per):
            samples += _decode(tokenizer, generate(model, chunk, num_generations=k, max_new_tokens=max_new_tokens,
                                                   temperature=temperature, stop_ids=stop,
                                                   pad_id=tokenizer.pad_id, generator=gen))
        ok = gsm8k_accuracy(None, samples, [a for a in answers for _ in range(k)])
        correct = [int(sum(ok[i * k:(i + 1) * k])) for i in range(len(rows))]
        for j in sorted({1, k} | {x for x in (2, 4) if x < k}):
            out[f"pass@{j}"] = sum(pass_at_k(k, c, j) for c in correct) / len(rows)
        maj = 0
        for i in range(len(rows)):
            votes = Counter(a for a in (extract_hash_answer(s) for s in samples[i * k:(i + 1) * k]) if a is not None)
            if votes and votes.most_common(1)[0][0] == reference_answer(answers[i]):
                maj += 1
        out[f"maj@{k}"] = maj / len(rows)
    out["samples"] = [{"prompt": r["prompt"], "answer": r["answer"], "greedy": g, "greedy_correct": bool(ok_),
                       **({"samples": samples[i * k:(i + 1) * k]} if samples else {})}
                      for i, (r, g, ok_) in enumerate(zip(rows, greedy, greedy_ok))]
    return out
