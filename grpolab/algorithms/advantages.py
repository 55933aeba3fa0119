"""Advantage estimators: per-completion advantages from rewards grouped by prompt.

Each estimator is a pure function `(rewards (N,), group_ids (N,), **opts) -> (N,)`,
registered by name; the trainer picks one with `algorithm.adv_estimator`.
"""

from __future__ import annotations

from typing import Callable

import torch

ADV_ESTIMATORS: dict[str, Callable[..., torch.Tensor]] = {}


def register(name: str):
    def deco(fn):
        ADV_ESTIMATORS[name] = fn
        return fn
    return deco


def group_stats(rewards: torch.Tensor, group_ids: torch.Tensor, unbiased_std: bool = False):
    """Per-element group mean, group std and group size, each (N,).

    A group of one has std 0 (its advantage is 0 under every estimator anyway).
    """
    _, inv, counts = torch.unique(group_ids, return_inverse=True, return_counts=True)
    r = rewards.double()
    n = counts.double()
    sums = torch.zeros(len(counts), dtype=r.dtype, device=r.device).index_add_(0, inv, r)
    mean = sums / n
    sq = torch.zeros_like(sums).index_add_(0, inv, (r - mean[inv]) ** 2)
    denom = (n - 1).clamp(min=1) if unbiased_std else n
    std = (sq / denom).sqrt()
    return mean[inv], std[inv], n[inv]


@register("grpo")
def grpo_advantages(rewards: torch.Tensor, group_ids: torch.Tensor, *, eps: float = 1e-4,
                    unbiased_std: bool = False, scale_rewards: str = "group") -> torch.Tensor:
    """GRPO (Shao et al. 2024, DeepSeekMath): A_i = (r_i - mean_g(r)) / (std_g(r) + eps).

    scale_rewards: 'group' divides by the group's std, 'batch' by the std of all rewards,
    'none' keeps r_i - mean_g(r) (Dr. GRPO, Liu et al. 2025). unbiased_std uses n-1.
    """
    mean, std, n = group_stats(rewards, group_ids, unbiased_std)
    adv = rewards.double() - mean
    if scale_rewards == "group":
        adv = adv / (std + eps)
    elif scale_rewards == "batch":
        adv = adv / (rewards.double().std(unbiased=unbiased_std) + eps)
    elif scale_rewards != "none":
        raise ValueError(f"scale_rewards must be group, batch or none, got {scale_rewards!r}")
    return torch.where(n > 1, adv, torch.zeros_like(adv)).to(rewards.dtype)


@register("dr_grpo")
def dr_grpo_advantages(rewards: torch.Tensor, group_ids: torch.Tensor, **_) -> torch.Tensor:
    """Dr. GRPO (Liu et al. 2025) and nanochat: A_i = r_i - mean_g(r), no std scaling."""
    return grpo_advantages(rewards, group_ids, scale_rewards="none")


def compute_advantages(rewards: torch.Tensor, group_ids: torch.Tensor, estimator: str = "grpo",
                       **opts) -> torch.Tensor:
    """Advantages (N,) for `rewards` (N,) float and `group_ids` (N,) int, by estimator name."""
    try:
        fn = ADV_ESTIMATORS[estimator]
    except KeyError:
        raise ValueError(f"unknown adv_estimator {estimator!r}; known: {', '.join(ADV_ESTIMATORS)}") from None
    return fn(rewards, group_ids, **opts)
