"""Log-probabilities of a prompt's own tokens (vLLM's `prompt_logprobs`, and the completions API's
`echo` with `logprobs`): how likely the model found each prompt token given the tokens before it.

The batcher computes them from the prefill's logits at every prompt position (only for the jobs that
ask; see Batcher._admit), so they are the model's log_softmax over the full prompt, the same numbers
a plain forward over the whole sequence gives.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# positions scored at a time: the float32 log-softmax of a long prompt is never held whole
CHUNK = 512


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
    out: list[PromptLogprob | None] = [None]
    for a in range(0, len(ids) - 1, CHUNK):   # position i predicts token i + 1
        b = min(a + CHUNK, len(ids) - 1)
        logp = logits[a:b].float().log_softmax(-1)
        chosen = logp.gather(-1, torch.tensor(ids[a + 1:b + 1], device=logp.device)[:, None])
        ranks = (logp > chosen).sum(-1)
        top = logp.topk(k, dim=-1) if k else None
        tops = zip(top.indices.tolist(), top.values.tolist()) if k else ([[], []] for _ in range(b - a))
        out += [PromptLogprob(lp, rank + 1, list(zip(t_ids, t_lps)))
                for lp, rank, (t_ids, t_lps) in zip(chosen[:, 0].tolist(), ranks.tolist(), tops)]
    return out[:len(ids)]
