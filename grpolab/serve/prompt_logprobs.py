"""Log-probabilities of a prompt's own tokens (vLLM's `prompt_logprobs`, and the completions API's
`echo` with `logprobs`): how likely the model found each prompt token given the tokens before it.

The batcher computes them from the prefill's logits at every prompt position (only for the jobs that
ask; see Batcher._admit), so they are the model's log_softmax over the full prompt, the same numbers
a plain forward over the whole sequence gives.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PromptLogprob:
    """One prompt token's score: its log-prob, its rank in the vocabulary (1: the most likely token)
    and the k most likely tokens at its position as (id, log-prob), most likely first."""
    logprob: float
    rank: int
    top: list[tuple[int, float]]


def prompt_logprobs(logits: torch.Tensor, ids: list[int], k: int) -> list[PromptLogprob | None]:
    """Scores of `ids[1:]` from `logits` (L, V), the model's logits at the prompt's L positions:
    token i has log-prob logp_i = log_softmax(logits[i - 1])[ids[i]] and rank 1 + #{v : logp(v) > logp_i}.
    The first entry is None: nothing precedes the first token, so the model gives it no probability."""
    if len(ids) < 2:
        return [None] * len(ids)
    logp = logits[:-1].float().log_softmax(-1)                      # (L - 1, V): position i predicts token i + 1
    target = torch.tensor(ids[1:], device=logp.device)[:, None]
    chosen = logp.gather(-1, target)                                 # (L - 1, 1)
    ranks = (logp > chosen).sum(-1) + 1
    top = logp.topk(k, dim=-1) if k else None
    tops = zip(top.indices.tolist(), top.values.tolist()) if k else ([[], []] for _ in ranks)
    return [None] + [PromptLogprob(lp, rank, list(zip(t_ids, t_lps)))
                     for lp, rank, (t_ids, t_lps) in zip(chosen[:, 0].tolist(), ranks.tolist(), tops)]
