"""Rollout correction: the sampler's and the trainer's probabilities of the same tokens differ (bf16
sampling, a separate decode path such as lean decode, a stale sampler), so the "on-policy" samples
are slightly off-policy. Importance weights between the two fix or flag it.

    rho_t = pi_trainer(y_t) / pi_sampler(y_t) = exp(old_logp_t - sampler_logp_t)       (token level)
    rho   = prod_t rho_t                                                             (sequence level)

    tis: the per-token loss is multiplied by min(rho, threshold) (truncated importance sampling;
         Ionides 2008; Yao et al. 2025, "Your efficient RL framework secretly brings you off-policy RL")
    mis: tokens (or whole completions) with rho outside [1/threshold, threshold] get no loss (masked
         importance sampling, as verl's rollout rejection and OpenRLHF's icepop)
"""

from __future__ import annotations

import torch


def rollout_correction(old_logp: torch.Tensor, sampler_logp: torch.Tensor, mask: torch.Tensor, *,
                       mode: str = "none", level: str = "token",
                       threshold: float = 2.0) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """(weights (B, T), mask (B, T), metric sums). Weights are detached (1 for mode 'none' or 'mis');
    the mask is `mask` with MIS's rejected tokens removed. Metrics, whatever the mode:
    'rollout/logprob_abs_diff_sum' (sum of |old - sampler| over active tokens), 'rollout/ratio_sum' (sum of rho
    over them) and 'rollout/ratio_max'."""
    m = mask.bool()
    diff = torch.where(m, old_logp.detach().double() - sampler_logp.double(), torch.zeros((), dtype=torch.float64))
    if level == "token":
        log_rho = diff
    elif level == "sequence":
        log_rho = diff.sum(-1, keepdim=True).expand_as(diff)
    else:
        raise ValueError(f"rollout_correction_level must be token or sequence, got {level!r}")
    rho = torch.exp(log_rho)
    metrics = {"rollout/logprob_abs_diff_sum": float(diff.abs().sum()),
               "rollout/ratio_sum": float(torch.where(m, rho, torch.zeros_like(rho)).sum()),
               "rollout/ratio_max": float(torch.where(m, rho, torch.zeros_like(rho)).max()) if m.any() else 0.0}
    weights = torch.ones_like(old_logp)
    if mode == "tis":
        weights = torch.where(m, rho.clamp(max=threshold), torch.zeros_like(rho)).to(old_logp.dtype)
    elif mode == "mis":
        keep = (rho <= threshold) & (rho >= 1.0 / threshold)
        metrics["rollout/masked_sum"] = float((m & ~keep).sum())
        m = m & keep
    elif mode != "none":
        raise ValueError(f"rollout_correction must be none, tis or mis, got {mode!r}")
    return weights, m, metrics
