"""Advantage estimators' formulas: per-completion advantages from rewards grouped by prompt, and
per-token ones from token rewards. algorithms/estimators.py registers them by name, with one signature.

The group estimators are pure functions `(rewards (N,), group_ids (N,), **opts) -> (N,)`; the trainer
passes the same opts (eps, unbiased_std, scale_rewards) to every estimator, so each one ignores the opts
it does not use. A group of one has no baseline: its advantage is 0 under every estimator. Statistics
are taken in float64; the result has rewards' dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config.names import SCALE_REWARDS


@dataclass(frozen=True)
class AdvantageInputs:
    """What an estimator may read of a batch (the registry's one signature: `fn(inputs, **opts)`)."""
    rewards: torch.Tensor                       # (N,) each completion's reward
    group_ids: torch.Tensor                     # (N,) the prompt each completion answers
    token_rewards: torch.Tensor | None = None   # (N, C) token-level estimators: the reward at the last token,
    #                                             minus beta * KL per token with algorithm.kl_in_reward
    mask: torch.Tensor | None = None            # (N, C) the completion tokens that count
    values: torch.Tensor | None = None          # (N, C) estimators with a critic: its values at rollout time
    baselines: torch.Tensor | None = None       # (N,) greedy-baseline estimators: the prompt's greedy reward


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


def dr_grpo_advantages(rewards: torch.Tensor, group_ids: torch.Tensor, **_) -> torch.Tensor:
    """Dr. GRPO (Liu et al. 2025, "Understanding R1-Zero-Like Training") and nanochat:

        A_i = r_i - mean_g(r)        (no std scaling; scale_rewards is ignored)
    """
    return grpo_advantages(rewards, group_ids, scale_rewards="none")


def rloo_advantages(rewards: torch.Tensor, group_ids: torch.Tensor, **_) -> torch.Tensor:
    """RLOO (Kool et al. 2019; Ahmadian et al. 2024, "Back to Basics"): leave-one-out baseline.

        A_i = r_i - 1/(G-1) * sum_{j != i} r_j  =  G/(G-1) * (r_i - mean_g(r))
    """
    mean, _, n = group_stats(rewards, group_ids)
    adv = n / (n - 1).clamp(min=1) * (rewards.double() - mean)
    return _finish(adv, n, rewards)


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


# ---------------------------------------------------------------------------- token-level estimators
#
# These work on (B, T) token rewards (the sequence score at the last completion token, minus
# beta * KL per token with algorithm.kl_in_reward) and return (advantages, returns), both (B, T).
# Positions where `mask` is 0 (padding, or tool output inside a completion) are skipped: they get
# no reward, no advantage, and the recursions carry their running values through them unchanged.

def token_level_rewards(scores: torch.Tensor, mask: torch.Tensor, kl: torch.Tensor | None = None,
                        beta: float = 0.0) -> torch.Tensor:
    """(B, T) token rewards: each completion's score at its last active token, minus beta * KL per
    token (algorithm.kl_in_reward: PPO-RLHF's shaping) at every active one."""
    m = mask.bool()
    out = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
    pos = torch.arange(mask.size(1), device=mask.device)
    last = torch.where(m, pos, -1).max(-1).values
    rows = (last >= 0).nonzero().squeeze(-1)
    out[rows, last[rows]] = scores[rows].float()
    if kl is not None and beta:
        out = out - beta * torch.where(m, kl.float(), torch.zeros_like(out))
    return out


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """(x - mean) / sqrt(var + eps) over the active positions (mean and unbiased variance in float64);
    0 at masked positions."""
    m = mask.bool()
    v = x.double()[m]
    if v.numel() < 2:
        return torch.zeros_like(x)
    out = (x.double() - v.mean()) / torch.sqrt(v.var(unbiased=True) + eps)
    return torch.where(m, out, torch.zeros_like(out)).to(x.dtype)


def compute_gae(token_rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float,
                lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized advantage estimation (Schulman et al. 2016), PPO's critic-based advantages:

        delta_t = r_t + gamma * V_{t'} - V_t        (t' = the next active position; V = 0 past the end)
        A_t     = delta_t + gamma * lam * A_{t'}
        returns = A + V (the critic's targets), advantages = A whitened over the active tokens
    """
    m = mask.to(values.dtype)
    B, T = values.shape
    next_v = torch.zeros(B, dtype=values.dtype, device=values.device)
    last = torch.zeros_like(next_v)
    adv = torch.zeros_like(values)
    for t in reversed(range(T)):
        delta = token_rewards[:, t] + gamma * next_v - values[:, t]
        a = delta + gamma * lam * last
        next_v = values[:, t] * m[:, t] + next_v * (1 - m[:, t])
        last = a * m[:, t] + last * (1 - m[:, t])
        adv[:, t] = last
    returns = (adv + values) * m
    return masked_whiten(adv, mask), returns


def compute_reinforce_plus_plus(token_rewards: torch.Tensor, mask: torch.Tensor,
                                gamma: float) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ (Hu et al. 2025, arXiv:2501.03262): discounted token returns, no critic, no group;
    the KL penalty lives in the token rewards, and the returns are whitened over the batch.

        G_t = r_t + gamma * G_{t'}     advantages = whiten(G) over the active tokens
    """
    m = mask.to(token_rewards.dtype)
    running = torch.zeros(token_rewards.size(0), dtype=token_rewards.dtype, device=token_rewards.device)
    returns = torch.zeros_like(token_rewards)
    for t in reversed(range(token_rewards.size(1))):
        g = token_rewards[:, t] + gamma * running
        returns[:, t] = g * m[:, t]
        running = g * m[:, t] + running * (1 - m[:, t])
    return masked_whiten(returns, mask), returns


def compute_remax(token_rewards: torch.Tensor, baselines: torch.Tensor,
                  mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """ReMax (Li et al. 2024, arXiv:2310.10505): the baseline is the reward of the prompt's greedy
    completion.

        G_t = sum_{s >= t, active} r_s     A_t = G_t - b (b: the prompt's greedy reward)
    """
    m = mask.to(token_rewards.dtype)
    returns = (token_rewards * m).flip(-1).cumsum(-1).flip(-1) * m
    return (returns - baselines[:, None].to(returns.dtype)) * m, returns
