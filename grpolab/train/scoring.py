"""The scoring stage: the reward functions' weighted total per completion (and per function, NaN where one
does not apply), ReMax's greedy baselines, DAPO's overlong shaping."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..algorithms.shaping import overlong_penalty
from ..rewards.combine import RewardLog, TrainerState
from ..rewards.combine import score as score_rewards
from ..rewards.runtime import RewardRuntime
from ..rollout.batch import RolloutBatch


@dataclass(frozen=True)
class Rewards:
    """How a run scores: reward.functions with their weights under the run's reward settings (timeout, sandbox),
    and algorithm.overlong_* shaping."""
    functions: list
    weights: list | None
    overlong_buffer: int = 0
    overlong_penalty: float = 1.0
    max_new_tokens: int = 0
    runtime: RewardRuntime = field(default_factory=RewardRuntime)


def score(batch: RolloutBatch, rewards: Rewards, state: TrainerState, policy=None) -> dict[str, list[float]]:
    """Fill batch.rewards, reward_columns, logged, score_keys, scorable (and baselines with greedy
    completions). `policy`: what intrinsic rewards read (rewards/intrinsic.PolicyView). Returns the scalars
    the functions logged with log_metric."""
    log = RewardLog(len(batch))
    batch.rewards, batch.reward_columns = score_rewards(
        rewards.functions, rewards.weights, batch.prompts, batch.completions, batch.columns,
        completion_ids=batch.completion_id_lists(), trainer_state=state, log=log, policy=policy,
        runtime=rewards.runtime)
    if batch.greedy is not None:   # the greedy completions' rewards are the baselines
        batch.baselines, _ = score_rewards(rewards.functions, rewards.weights, batch.prompts, batch.greedy,
                                           batch.columns, completion_ids=batch.greedy_ids, trainer_state=state,
                                           runtime=rewards.runtime)
    batch.logged, batch.score_keys = log.columns, log.score_keys
    batch.scorable = ~torch.stack(list(batch.reward_columns.values())).isnan().all(0)
    if rewards.overlong_buffer:
        pen = overlong_penalty(batch.gen.completion_mask.sum(-1).cpu(), rewards.max_new_tokens,
                               rewards.overlong_buffer, rewards.overlong_penalty)
        batch.reward_columns["overlong"] = pen
        batch.rewards = batch.rewards + pen
    return log.metrics
