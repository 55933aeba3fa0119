"""The advantage estimators by name (`algorithm.adv_estimator`), one signature for all of them:

    fn(inputs: AdvantageInputs, **opts) -> (advantages, returns)

advantages are (N,) for the group estimators and (N, C) for the token-level ones; returns are None, or
(N, C) where a token-level estimator has them (gae: the critic's targets). opts are every option the
trainer has (eps, unbiased_std, scale_rewards, gamma, lam); each estimator ignores the ones it does not
use. An entry's flags tell the trainer, once, what the estimator needs: token-level rewards (which are
whitened over the batch, so one process), a critic, or each prompt's greedy completion.

A new estimator is a function with this signature in a file of its own and one line in config/names.py's
ADV_ESTIMATORS naming it (docs/architecture.md shows one); a token-level one, or one with a critic or greedy
baselines, names an Estimator with its flags instead.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..config.names import ADV_ESTIMATORS, load
from .advantages import (
    AdvantageInputs,
    compute_gae,
    compute_reinforce_plus_plus,
    compute_remax,
    dr_grpo_advantages,
    grpo_advantages,
    grpo_passk_advantages,
    reinforce_baseline_advantages,
    rloo_advantages,
)

Advantages = tuple[torch.Tensor, torch.Tensor | None]


@dataclass(frozen=True)
class Estimator:
    fn: Callable[..., Advantages]   # fn(inputs, **opts) -> (advantages, returns or None)
    token_level: bool = False       # reads token_rewards and mask; (N, C) advantages
    critic: bool = False            # reads values: the run trains a critic (PPO)
    greedy: bool = False            # reads baselines: each prompt's greedy completion is sampled and scored


def by_group(formula: Callable[..., torch.Tensor]) -> Callable[..., Advantages]:
    """A group estimator's formula `(rewards, group_ids, **opts) -> (N,)` under the registry's signature."""
    def fn(x: AdvantageInputs, **opts) -> Advantages:
        return formula(x.rewards, x.group_ids, **opts), None
    fn.__doc__ = formula.__doc__
    return fn


def gae(x: AdvantageInputs, *, gamma: float = 1.0, lam: float = 1.0, **_) -> Advantages:
    return compute_gae(x.token_rewards, x.values, x.mask, gamma, lam)


def reinforce_plus_plus(x: AdvantageInputs, *, gamma: float = 1.0, **_) -> Advantages:
    return compute_reinforce_plus_plus(x.token_rewards, x.mask, gamma)


def remax(x: AdvantageInputs, **_) -> Advantages:
    return compute_remax(x.token_rewards, x.baselines.to(x.mask.device), x.mask)


# the built-in estimators, each named in config/names.py's ADV_ESTIMATORS
GRPO = Estimator(by_group(grpo_advantages))
DR_GRPO = Estimator(by_group(dr_grpo_advantages))
RLOO = Estimator(by_group(rloo_advantages))
REINFORCE_BASELINE = Estimator(by_group(reinforce_baseline_advantages))
GRPO_PASSK = Estimator(by_group(grpo_passk_advantages))
GAE = Estimator(gae, token_level=True, critic=True)
REINFORCE_PLUS_PLUS = Estimator(reinforce_plus_plus, token_level=True)
REMAX = Estimator(remax, token_level=True, greedy=True)


def get_estimator(name: str) -> Estimator:
    """The estimator ADV_ESTIMATORS names `name` (a plain function there is a group estimator, without flags)."""
    entry = load(ADV_ESTIMATORS, name, "algorithm.adv_estimator")
    return entry if isinstance(entry, Estimator) else Estimator(entry)


def compute_advantages(rewards: torch.Tensor, group_ids: torch.Tensor, estimator: str = "grpo",
                       **opts) -> torch.Tensor:
    """Advantages (N,) of a group estimator for `rewards` (N,) float and `group_ids` (N,) int."""
    entry = get_estimator(estimator)
    if entry.token_level:
        raise ValueError(f"adv_estimator {estimator!r} is token-level: it needs token rewards and a mask "
                         f"(AdvantageInputs), not a group's rewards alone")
    return entry.fn(AdvantageInputs(rewards, group_ids), **opts)[0]
