"""Reduce a per-token loss matrix to a scalar.

Every mode divides by counts over the *global* batch (passed in by the trainer), so
summing the micro-batch losses gives exactly the full-batch loss: the gradient does not
depend on the micro-batch size or on gradient accumulation.
"""

from __future__ import annotations

import torch

from ..config.names import AGG_MODES


def aggregate(loss_mat: torch.Tensor, mask: torch.Tensor, mode: str = "token-mean", *,
              global_tokens: float | None = None, global_seqs: float | None = None,
              max_new_tokens: int | None = None) -> torch.Tensor:
    """Scalar loss from loss_mat (B, T) over mask (B, T).

    token-mean:              sum_{i,t} l / N_tokens                       (DAPO, TRL 'dapo')
    seq-mean-token-mean:     sum_i (sum_t l / |o_i|) / N_seqs            (original GRPO)
    seq-mean-token-sum:      sum_i sum_t l / N_seqs
    seq-mean-token-sum-norm: sum_{i,t} l / (N_seqs * max_new_tokens)     (Dr. GRPO)
    N_tokens / N_seqs count active tokens / rows with at least one active token in the global
    batch (a row with no active token is not a sequence); when not given they are taken from
    this batch. |o_i| is the row's active-token count.
    """
    m = mask.bool()
    tok_per_row = m.sum(-1).to(loss_mat.dtype)
    if global_tokens is None:
        global_tokens = float(tok_per_row.sum())
    if global_seqs is None:
        global_seqs = float((tok_per_row > 0).sum())
    # where, not a product: inf/NaN at masked positions neither leaks into the value nor the gradient
    row_sum = torch.where(m, loss_mat, torch.zeros_like(loss_mat)).sum(-1)
    total = row_sum.sum()
    if mode == "token-mean":
        return total / max(global_tokens, 1.0)
    if mode == "seq-mean-token-mean":
        return (row_sum / tok_per_row.clamp(min=1)).sum() / max(global_seqs, 1.0)
    if mode == "seq-mean-token-sum":
        return total / max(global_seqs, 1.0)
    if mode == "seq-mean-token-sum-norm":
        if not max_new_tokens:
            raise ValueError("loss_agg_mode seq-mean-token-sum-norm needs max_new_tokens")
        return total / (max(global_seqs, 1.0) * max_new_tokens)
    raise ValueError(f"unknown loss_agg_mode {mode!r}; use one of {', '.join(AGG_MODES)}")
