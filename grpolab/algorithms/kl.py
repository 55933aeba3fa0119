"""KL estimators between the policy and the reference, per token (Schulman, "Approximating KL", 2020).

With log-ratio d = log pi(x) - log pi_ref(x), x sampled from pi:
    k1 = d                      unbiased, high variance, can be negative
    k2 = d^2 / 2                biased, low variance
    k3 = exp(-d) - 1 + d        unbiased, low variance, always >= 0 (used by GRPO)
"""

from __future__ import annotations

import torch

K3_CLAMP = 10.0  # bound per-token k3 so one far-off token cannot dominate the loss (as verl does)


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str = "k3") -> torch.Tensor:
    """Per-token KL estimate (B, T) from policy and reference log-probs of the sampled tokens."""
    d = logp - ref_logp
    if estimator == "k1":
        return d
    if estimator == "k2":
        return 0.5 * d.square()
    if estimator == "k3":
        return (torch.exp(-d) - 1 + d).clamp(-K3_CLAMP, K3_CLAMP)
    raise ValueError(f"unknown kl_estimator {estimator!r}; use k1, k2 or k3")
