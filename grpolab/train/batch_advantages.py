"""The advantages stage: the batch's rewards (minus beta * KL with the KL in the reward) to advantages, by the
plan's estimator. Group estimators see every rank's rewards (batch-wide statistics); token-level ones get
token rewards and, per their registry flags, the critic's values or the greedy baselines. Rows no reward
function scored are left out of the baselines and get advantage 0 (as TRL does)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from .. import distributed as dist
from ..algorithms.advantages import AdvantageInputs, token_level_rewards
from ..algorithms.kl import apply_kl_in_reward, kl_penalty
from ..config.schema import AlgorithmConfig
from ..rollout.batch import RolloutBatch
from .plan import Plan


def scorable(batch: RolloutBatch) -> torch.Tensor:
    """(B,) bool: rows some reward function scored."""
    return batch.scorable if batch.scorable is not None else torch.ones(len(batch), dtype=torch.bool)


def options(a: AlgorithmConfig) -> dict:
    """Every estimator option; each estimator reads the ones it uses."""
    return dict(eps=a.adv_eps, unbiased_std=a.unbiased_std, scale_rewards=a.scale_rewards, gamma=a.gamma, lam=a.lam)


def advantages(batch: RolloutBatch, plan: Plan, a: AlgorithmConfig, ref_lp: torch.Tensor | None,
               world: dist.World, values: Callable[[RolloutBatch], torch.Tensor] | None = None) -> dict:
    """batch.advantages (and batch.returns, batch.values where the estimator has them); returns the KL metric
    with the KL in the reward. `values(batch)`: the critic's values, for estimators that read them."""
    if plan.estimator.token_level:
        return _token_level(batch, plan, a, ref_lp, values)
    rewards, out = batch.rewards, {}
    if plan.kl == "reward":
        g = batch.gen
        kl = kl_penalty(g.sampler_logprobs, ref_lp, a.kl_estimator)
        rewards = apply_kl_in_reward(rewards, kl.cpu(), g.completion_mask.cpu(), a.beta)
        kl_sum, n_tok = dist.sum_floats(float((kl * g.completion_mask).sum()), float(g.completion_mask.sum()))
        out["kl"] = kl_sum / max(n_tok, 1.0)
    ok, group_ids = scorable(batch), batch.group_ids
    if world.size > 1:   # every reward of the step: batch-wide statistics are over all ranks
        B = len(batch)   # ranks can hold different numbers of rows (dynamic sampling)
        start = int(dist.gather_rows(torch.tensor([B]))[:world.rank].sum())
        rewards, ok = dist.gather_rows(rewards), dist.gather_rows(ok)
        group_ids = dist.gather_rows(group_ids + start)   # a rank's group ids are < its B: distinct
    fn, opts = plan.estimator.fn, options(a)
    if bool(ok.all()):
        adv = fn(AdvantageInputs(rewards, group_ids), **opts)[0]
    else:
        adv = torch.zeros_like(rewards)
        adv[ok] = fn(AdvantageInputs(rewards[ok], group_ids[ok]), **opts)[0]
    batch.advantages = adv[start:start + B] if world.size > 1 else adv
    return out


def _token_level(batch: RolloutBatch, plan: Plan, a: AlgorithmConfig, ref_lp: torch.Tensor | None,
                 values: Callable[[RolloutBatch], torch.Tensor] | None) -> dict:
    """Token rewards (the score at the last token, minus beta * KL per token with the KL in the reward), then
    the estimator; (B, C) advantages and returns. Unscored rows get no advantage and no value target."""
    g = batch.gen
    ok = scorable(batch).to(g.completion_mask.device)
    mask = g.completion_mask & ok[:, None]
    scores = torch.where(ok, batch.rewards.to(ok.device), torch.zeros_like(batch.rewards, device=ok.device))
    kl = kl_penalty(g.sampler_logprobs, ref_lp, a.kl_estimator) if plan.kl == "reward" else None
    out = {}
    if kl is not None:
        out["kl"] = float((kl * mask).sum() / mask.sum().clamp(min=1))
    if plan.estimator.critic:
        batch.values = values(batch)
    x = AdvantageInputs(scores, batch.group_ids, token_rewards=token_level_rewards(scores, mask, kl, a.beta),
                        mask=mask, values=batch.values, baselines=batch.baselines)
    batch.advantages, batch.returns = plan.estimator.fn(x, **options(a))
    return out
