"""KL estimators between the policy and the reference, per token (Schulman, "Approximating KL", 2020).

With log-ratio d = log pi(x) - log pi_ref(x), x sampled from pi:
    k1 = d                      unbiased, high variance, can be negative
    k2 = d^2 / 2                biased, low variance
    k3 = exp(-d) - 1 + d        unbiased, low variance, always >= 0 (used by GRPO)
Each estimator is a pure function (logp, ref_logp) -> (B, T), named in config/names.py's KL_ESTIMATORS
(`algorithm.kl_estimator`). They see no mask: padded positions must hold finite log-probs
(any value), otherwise the chain rule through a masked inf/NaN gives a NaN gradient.
The KL enters either the loss (beta * aggregate(kl), see train/) or the reward
(`apply_kl_in_reward`).
"""

from __future__ import annotations

import torch

from ..config.names import KL_ESTIMATORS, load

K3_CLAMP = 10.0  # bound per-token k3 so one far-off token cannot dominate the loss (as verl does)


def kl_k1(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """k1 = log pi - log pi_ref (the naive estimator; its gradient in the loss is just grad logp)."""
    return logp - ref_logp


def kl_k2(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """k2 = (log pi - log pi_ref)^2 / 2."""
    return 0.5 * (logp - ref_logp).square()


def kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """k3 = pi_ref/pi - 1 - log(pi_ref/pi) = exp(-d) - 1 + d, clamped to [-K3_CLAMP, K3_CLAMP]
    (the estimator of GRPO, Shao et al. 2024)."""
    # k3 > K3_CLAMP already for |d| >= K3_CLAMP + 1, so clamping d first changes no value; it only
    # keeps exp(-d) finite, so the clamped region has a zero (not 0 * inf = NaN) gradient
    d = (logp - ref_logp).clamp(-2 * K3_CLAMP, 2 * K3_CLAMP)
    return (torch.exp(-d) - 1 + d).clamp(-K3_CLAMP, K3_CLAMP)


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str = "k3") -> torch.Tensor:
    """Per-token KL estimate (B, T) from policy and reference log-probs of the sampled tokens."""
    return load(KL_ESTIMATORS, estimator, "algorithm.kl_estimator")(logp, ref_logp)


def apply_kl_in_reward(rewards: torch.Tensor, kl: torch.Tensor, mask: torch.Tensor,
                       beta: float) -> torch.Tensor:
    """KL as a reward penalty (InstructGPT, Ouyang et al. 2022; RLOO, Ahmadian et al. 2024):

        r'_i = r_i - beta * sum_t kl_i,t        (sum over the completion's active tokens)
    rewards: per-sequence scores (B,) or per-token rewards (B, T) (summed over active tokens
    first); kl: per-token estimate (B, T) from `kl_penalty`, usually k1 with the rollout's
    log-probs. The result (B,) is detached: a reward carries no gradient. Feed it to
    `compute_advantages` in place of the raw rewards.
    """
    m = mask.bool()
    if rewards.dim() == 2:
        rewards = torch.where(m, rewards, torch.zeros_like(rewards)).sum(-1)
    kl_sum = torch.where(m, kl, torch.zeros_like(kl)).sum(-1)
    return (rewards - beta * kl_sum.to(rewards.dtype)).detach()
