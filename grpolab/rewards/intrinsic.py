"""Intrinsic rewards: scores from the policy's own distributions, no labels (RLIF) or the reference
read through the policy (RLPR).

A reward function that names a `policy` parameter gets a PolicyView of the current policy for the
batch being scored. Its per-token statistics come from one no-grad forward over the batch, made on
first use and shared by every function that asks (no second copy of the model):

    view.token_stats() -> {"logprobs", "entropy", "self_certainty", "mask"}: (B, C) float32 tensors

Built-in rewards (per completion, over its tokens, stop token included):
    self_certainty      mean_t KL(U || pi(.|x, y<t)) = mean_t [-log V - mean_v log pi(v|x, y<t)]
                        (Kang et al. 2025; Intuitor, Zhao et al. 2025 "Learning to reason without
                        external rewards")
    token_entropy       -mean_t H(pi(.|x, y<t))                           (lower entropy pays)
    trajectory_logprob  (1/|y|) log pi(y|x)
    rlpr                RLPR (Yu et al. 2025, "Reinforcing general reasoning without verifiers"): the
                        completion's final answer is replaced by the reference; reward = mean per-token
                        probability of the reference answer's tokens after prompt + reasoning, minus the
                        same after the prompt alone (the debiasing baseline), clipped to [0, 1]
Certainty rewards help early and then collapse: the policy learns to be sure, not right (docs/algorithms.md).
"""

from __future__ import annotations

import math

import torch

from ..data.answers import final_answer_text
from ..utils.padding import pad_sequences
from .calling import completion_texts

ANSWER_MARK = "#### "


class PolicyView:
    """The current policy, read-only, for one batch: `gen` holds its padded prompt/completion ids."""

    def __init__(self, model, tokenizer, gen, chunk_rows: int = 64) -> None:
        self.model, self.tok, self.gen = model, tokenizer, gen
        self.chunk_rows = chunk_rows
        self._stats: dict | None = None

    @torch.no_grad()
    def token_stats(self) -> dict[str, torch.Tensor]:
        """Per completion token (at temperature 1): log-prob of the sampled token, entropy of the
        next-token distribution and its KL from uniform; computed once per batch."""
        if self._stats is None:
            g = self.gen
            parts = [self._stats_of(slice(i, i + self.chunk_rows)) for i in range(0, g.completion_ids.size(0),
                                                                                  self.chunk_rows)]
            self._stats = {k: torch.cat([p[k] for p in parts]) for k in parts[0]}
            self._stats["mask"] = g.completion_mask.float().cpu()
        return self._stats

    def _stats_of(self, sl: slice) -> dict[str, torch.Tensor]:
        g = self.gen
        C = g.completion_ids.size(1)
        ids = torch.cat([g.prompt_ids[sl], g.completion_ids[sl]], 1)
        valid = torch.cat([g.prompt_mask[sl], g.context_mask[sl]], 1)
        was_training = self.model.training
        self.model.eval()
        logits = self.model(ids[:, :-1], key_valid=valid[:, :-1], logits_to_keep=C).float()
        self.model.train(was_training)
        lp = logits.log_softmax(-1)
        m = g.completion_mask[sl].float()
        tok = lp.gather(-1, g.completion_ids[sl][..., None]).squeeze(-1)
        ent = -(lp.exp() * lp).sum(-1)
        cert = -math.log(lp.size(-1)) - lp.mean(-1)
        return {"logprobs": (tok * m).cpu(), "entropy": (ent * m).cpu(), "self_certainty": (cert * m).cpu()}

    @torch.no_grad()
    def mean_token_prob(self, prefixes: list[list[int]], targets: list[list[int]]) -> list[float]:
        """For each (prefix, target) pair: the mean over the target's tokens of pi(token | prefix, earlier
        target tokens)."""
        out = []
        device = next(self.model.parameters()).device
        for i in range(0, len(prefixes), self.chunk_rows):
            pre, tgt = prefixes[i:i + self.chunk_rows], targets[i:i + self.chunk_rows]
            ids, valid = pad_sequences([p + t for p, t in zip(pre, tgt)], self.tok.pad_id, "right")
            was_training = self.model.training
            self.model.eval()
            lp = self.model(ids[:, :-1].to(device), key_valid=valid[:, :-1].to(device)).float().log_softmax(-1)
            self.model.train(was_training)
            for b, (p, t) in enumerate(zip(pre, tgt)):
                pos = torch.arange(len(p) - 1, len(p) + len(t) - 1, device=device)
                probs = lp[b, pos, torch.tensor(t, device=device)].exp()
                out.append(float(probs.mean()))
        return out


def _per_row(view: PolicyView, key: str) -> list[float]:
    s = view.token_stats()
    n = s["mask"].sum(-1).clamp(min=1)
    return (s[key].sum(-1) / n).tolist()


def self_certainty(completions, policy: PolicyView, **_) -> list[float]:
    """Mean over the completion's tokens of KL(Uniform || pi(.|x, y<t)): how far from a uniform guess."""
    return _per_row(policy, "self_certainty")


def token_entropy(completions, policy: PolicyView, **_) -> list[float]:
    """Minus the mean next-token entropy over the completion: confident completions pay."""
    return [-x for x in _per_row(policy, "entropy")]


def trajectory_logprob(completions, policy: PolicyView, **_) -> list[float]:
    """(1/|y|) log pi(y|x): the completion's mean token log-probability."""
    return _per_row(policy, "logprobs")


def _reference(answer) -> str:
    text = str(answer)
    final = final_answer_text(text)
    return final if final is not None else text.strip()


def rlpr(prompts, completions, answer, policy: PolicyView, **_) -> list[float]:
    """RLPR's probability reward for completions ending in '#### <answer>' (GSM8K's convention): the
    reasoning is the text before the last '####' (the whole completion when there is none)."""
    tok = policy.tok
    texts = completion_texts(completions)
    prefixes, targets, bare = [], [], []
    for p, c, a in zip(prompts, texts, answer):
        reasoning = c.rsplit("####", 1)[0] if "####" in c else c.rstrip() + "\n"
        prompt_ids = tok.render_prompt(p)
        target = tok.encode(_reference(a))
        prefixes.append(prompt_ids + tok.encode(reasoning + ANSWER_MARK))
        bare.append(prompt_ids + tok.encode(ANSWER_MARK))
        targets.append(target or [tok.eos_id])
    with_reasoning = policy.mean_token_prob(prefixes, targets)
    # the reasoning-free baseline depends on the prompt and reference only: once per distinct pair,
    # not once per completion of the group
    pairs = list(dict.fromkeys((tuple(b), tuple(t)) for b, t in zip(bare, targets)))
    base = dict(zip(pairs, policy.mean_token_prob([list(b) for b, _ in pairs], [list(t) for _, t in pairs])))
    return [min(1.0, max(0.0, r - base[(tuple(b), tuple(t))])) for r, b, t in zip(with_reasoning, bare, targets)]
