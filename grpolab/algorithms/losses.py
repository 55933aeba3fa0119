"""Policy losses on per-token log-probs, registered by name (`algorithm.policy_loss`)."""

from __future__ import annotations

from typing import Callable

import torch

from .aggregate import aggregate

POLICY_LOSSES: dict[str, Callable[..., tuple[torch.Tensor, dict]]] = {}


def register(name: str):
    def deco(fn):
        POLICY_LOSSES[name] = fn
        return fn
    return deco


@register("clip")
def clip_loss(logp, old_logp, adv, mask, *, epsilon: float = 0.2, epsilon_high: float | None = None,
              clip_ratio_c: float | None = None, **_) -> tuple[torch.Tensor, dict]:
    """PPO clipped surrogate (Schulman et al. 2017) as used by GRPO, per token:

        r = exp(logp - old_logp)
        l = max(-A * r, -A * clip(r, 1 - epsilon, 1 + epsilon_high))
    epsilon_high defaults to epsilon (DAPO's clip-higher raises it). With clip_ratio_c
    (dual clip, Ye et al. 2020), for A < 0: l = min(l, -A * clip_ratio_c).
    Returns the per-token loss matrix and detached clip indicators for metrics.
    """
    eps_hi = epsilon if epsilon_high is None else epsilon_high
    ratio = torch.exp(logp - old_logp)
    l1 = -adv * ratio
    l2 = -adv * ratio.clamp(1 - epsilon, 1 + eps_hi)
    loss = torch.maximum(l1, l2)
    if clip_ratio_c is not None:
        loss = torch.where(adv < 0, torch.minimum(loss, -adv * clip_ratio_c), loss)
    with torch.no_grad():
        low = (ratio < 1 - epsilon) & (adv < 0)
        high = (ratio > 1 + eps_hi) & (adv > 0)
    return loss, {"clip_low": low, "clip_high": high}


def compute_policy_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor,
                        mask: torch.Tensor, *, policy_loss: str = "clip",
                        loss_agg_mode: str = "token-mean", epsilon: float = 0.2,
                        epsilon_high: float | None = None, clip_ratio_c: float | None = None,
                        max_new_tokens: int | None = None, global_tokens: float | None = None,
                        global_seqs: float | None = None) -> tuple[torch.Tensor, dict]:
    """Scalar policy loss and metrics.

    logp, old_logp, mask: (B, T); advantages: (B,) or (B, T). global_tokens/global_seqs
    are the normalizers of the whole batch when this call sees only a micro-batch.
    Metrics are sums over this call's active tokens (`clip_ratio/*_sum`) so the caller
    can add them up across micro-batches and divide by the global token count.
    """
    try:
        fn = POLICY_LOSSES[policy_loss]
    except KeyError:
        raise ValueError(f"unknown policy_loss {policy_loss!r}; known: {', '.join(POLICY_LOSSES)}") from None
    adv = advantages if advantages.dim() == 2 else advantages[:, None]
    loss_mat, info = fn(logp, old_logp, adv.to(logp.dtype), mask, epsilon=epsilon,
                        epsilon_high=epsilon_high, clip_ratio_c=clip_ratio_c)
    loss = aggregate(loss_mat, mask, loss_agg_mode, global_tokens=global_tokens,
                     global_seqs=global_seqs, max_new_tokens=max_new_tokens)
    m = mask.bool()
    low, high = info["clip_low"] & m, info["clip_high"] & m
    metrics = {"clip_ratio/low_sum": float(low.sum()), "clip_ratio/high_sum": float(high.sum()),
               "clip_ratio/region_sum": float((low | high).sum())}
    return loss, metrics
