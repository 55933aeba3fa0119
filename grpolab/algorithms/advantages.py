"""Advantage estimators: per-completion advantages from rewards grouped by prompt.

Each estimator is a pure function `(rewards (N,), group_ids (N,), **opts) -> (N,)`,
registered by name; the trainer picks one with `algorithm.adv_estimator`. The trainer
passes the same opts (eps, unbiased_std, scale_rewards) to every estimator, so each one
ignores the opts it does not use. A group of one has no baseline: its advantage is 0
under every estimator. Statistics are taken in float64; the result has rewards' dtype.
"""

from __future__ import annotations

from typing import Callable

import torch

ADV_ESTIMATORS: dict[str, Callable[..., torch.Tensor]] = {}
SCALE_REWARDS = ("group", "batch", "none")


def register(name: str):
    def deco(fn):
        ADV_ESTIMATORS[name] = fn
        return fn
    return deco


def group_stats(rewards: torch.Tensor, group_ids: torch.Tensor, unbiased_std: bool = False):
    """Per-element group mean, group std and group size, each (N,) float64.

    A group of one has std 0 (its advantage is 0 under every estimator anyway).
    """
    _, inv, counts = torch.unique(group_ids, return_inverse=True, return_counts=True)
    r = rewards.double()
    n = counts.to(r)
    sums = torch.zeros(len(counts), dtype=r.dtype, device=r.device).index_add_(0, inv, r)
    mean = sums / n
    sq = torch.zeros_like(sums).index_add_(0, inv, (r - mean[inv]) ** 2)
    denom = (n - 1).clamp(min=1) if unbiased_std else n
    std = (sq / denom).sqrt()
    return mean[inv], std[inv], n[inv]


def _safe_div(x: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """x / d, and x where d == 0 (then x is 0 too: a zero std means x is centred to 0; eps = 0 safe)."""
    return x / torch.where(d > 0, d, torch.ones_like(d))


def _scale(x: torch.Tensor, rewards: torch.Tensor, std_g: torch.Tensor, scale_rewards: str,
           eps: float, unbiased_std: bool) -> torch.Tensor:
    """Divide x by (std + eps): the group's std ('group'), all rewards' std ('batch'), or not ('none')."""
    if scale_rewards == "group":
        return _safe_div(x, std_g + eps)
    if scale_rewards == "batch":
        r = rewards.double()
        std_b = r.std(unbiased=unbiased_std) if r.numel() > 1 else r.new_zeros(())
        return _safe_div(x, std_b + eps)
    if scale_rewards == "none":
        return x
    raise ValueError(f"scale_rewards must be one of {', '.join(SCALE_REWARDS)}, got {scale_rewards!r}")


def _finish(adv: torch.Tensor, n: torch.Tensor, rewards: torch.Tensor) -> torch.Tensor:
    """Zero the advantage of groups of one and cast back to the rewards' dtype."""
    return torch.where(n > 1, adv, torch.zeros_like(adv)).to(rewards.dtype)


@register("grpo")
def grpo_advantages(rewards: torch.Tensor, group_ids: torch.Tensor, *, eps: float = 1e-4,
                    unbiased_std: bool = False, scale_rewards: str = "group", **_) -> torch.Tensor:
    """GRPO (Shao et al. 2024, DeepSeekMath): A_i = (r_i - mean_g(r)) / (std_g(r) + eps).

    scale_rewards: 'group' divides by the group's std, 'batch' by the std of all rewards
    (Hu et al. 2025), 'none' keeps r_i - mean_g(r) (Dr. GRPO, Liu et al. 2025).
    unbiased_std uses n-1 in the std.
    """
    mean, std, n = group_stats(rewards, group_ids, unbiased_std)
    adv = _scale(rewards.double() - mean, rewards, std, scale_rewards, eps, unbiased_std)
    return _finish(adv, n, rewards)


@register("dr_grpo")
def dr_grpo_advantages(rewards: torch.Tensor, group_ids: torch.Tensor, **_) -> torch.Tensor:
    """Dr. GRPO (Liu et al. 2025, "Understanding R1-Zero-Like Training") and nanochat:

        A_i = r_i - mean_g(r)        (no std scaling; scale_rewards is ignored)
    """
    return grpo_advantages(rewards, group_ids, scale_rewards="none")


@register("rloo")
def rloo_advantages(rewards: torch.Tensor, group_ids: torch.Tensor, **_) -> torch.Tensor:
    """RLOO (Kool et al. 2019; Ahmadian et al. 2024, "Back to Basics"): leave-one-out baseline.

        A_i = r_i - 1/(G-1) * sum_{j != i} r_j  =  G/(G-1) * (r_i - mean_g(r))
    """
    mean, _, n = group_stats(rewards, group_ids)
    adv = n / (n - 1).clamp(min=1) * (rewards.double() - mean)
    return _finish(adv, n, rewards)


@register("reinforce_baseline")
def reinforce_baseline_advantages(rewards: torch.Tensor, group_ids: torch.Tensor, *, eps: float = 1e-4,
                                  unbiased_std: bool = False, **_) -> torch.Tensor:
    """REINFORCE++-baseline (Hu et al. 2025, arXiv:2501.03262): group mean baseline, batch whitening.

        x_i = r_i - mean_g(r);   A_i = (x_i - mean_B(x)) / (std_B(x) + eps)
    B is every completion of a group of two or more (groups of one carry no signal and get 0).
    mean_B(x) is 0 up to rounding, since each group's x sums to 0. verl/OpenRLHF whiten over
    tokens (length-weighted); here every completion counts once.
    """
    mean, _, n = group_stats(rewards, group_ids)
    x = rewards.double() - mean
    keep = n > 1
    if keep.sum() == 0:
        return torch.zeros_like(rewards)
    xb = x[keep]
    std_b = xb.std(unbiased=unbiased_std) if xb.numel() > 1 else xb.new_zeros(())
    adv = _safe_div(x - xb.mean(), std_b + eps)
    return _finish(adv, n, rewards)


@register("grpo_passk")
def grpo_passk_advantages(rewards: torch.Tensor, group_ids: torch.Tensor, *, eps: float = 1e-4,
                          unbiased_std: bool = False, scale_rewards: str = "group", **_) -> torch.Tensor:
    """Pass@k-style GRPO (Tang et al. 2025, arXiv:2503.19595; verl's grpo_passk): only the best
    completion of each group learns.

        A_best = (r_max - r_second_max) / (std_g(r) + eps),   A_other = 0
    best = the first completion (lowest row index) with the group's maximum reward;
    r_second_max = max over the rest of the group (equals r_max on a tie, giving 0).
    scale_rewards: 'group' as above, 'batch' divides by all rewards' std, 'none' does not divide.
    """
    r = rewards.double()
    _, inv = torch.unique(group_ids, return_inverse=True)
    k = int(inv.max()) + 1 if inv.numel() else 0  # number of groups
    idx = torch.arange(len(r), device=r.device)
    gmax = torch.full((k,), -torch.inf, dtype=r.dtype, device=r.device).scatter_reduce(0, inv, r, "amax")
    # first row reaching the group max
    cand = torch.where(r == gmax[inv], idx, len(r))
    best = torch.full((k,), len(r), device=r.device).scatter_reduce(0, inv, cand, "amin")
    is_best = idx == best[inv]
    rest = torch.where(is_best, -torch.inf, r)
    second = torch.full((k,), -torch.inf, dtype=r.dtype, device=r.device).scatter_reduce(0, inv, rest, "amax")
    _, std, n = group_stats(rewards, group_ids, unbiased_std)
    gap = torch.where(is_best & (n > 1), gmax[inv] - second[inv], torch.zeros_like(r))
    return _finish(_scale(gap, rewards, std, scale_rewards, eps, unbiased_std), n, rewards)


def compute_advantages(rewards: torch.Tensor, group_ids: torch.Tensor, estimator: str = "grpo",
                       **opts) -> torch.Tensor:
    """Advantages (N,) for `rewards` (N,) float and `group_ids` (N,) int, by estimator name.

    opts (eps, unbiased_std, scale_rewards, ...) an estimator does not use are ignored.
    """
    try:
        fn = ADV_ESTIMATORS[estimator]
    except KeyError:
        raise ValueError(f"unknown adv_estimator {estimator!r}; known: {', '.join(ADV_ESTIMATORS)}") from None
    return fn(rewards, group_ids, **opts)
