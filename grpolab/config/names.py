"""The one declaration of each registry, as plain data: the names a config key may take and, for the registries
of functions and classes, where each one lives as "module:attr", which the module that uses the registry loads
on use (`load`). Reading or checking a config imports none of them, so no torch.

A new estimator, policy loss, KL estimator, reward or rollout source is its function (or class) in its file and
one line here (docs/architecture.md shows one); tests/test_config_names.py loads every line."""

from __future__ import annotations

import importlib
from typing import Any

from ..errors import ConfigError

# algorithm.adv_estimator: each an Estimator (algorithms/estimators.py; its flags say what it reads), or a
# function `fn(inputs, **opts) -> (advantages, returns)` of a group estimator
ADV_ESTIMATORS: dict[str, str] = {
    "grpo": "grpolab.algorithms.estimators:GRPO",
    "dr_grpo": "grpolab.algorithms.estimators:DR_GRPO",
    "rloo": "grpolab.algorithms.estimators:RLOO",
    "reinforce_baseline": "grpolab.algorithms.estimators:REINFORCE_BASELINE",
    "grpo_passk": "grpolab.algorithms.estimators:GRPO_PASSK",
    "gae": "grpolab.algorithms.estimators:GAE",
    "reinforce_plus_plus": "grpolab.algorithms.estimators:REINFORCE_PLUS_PLUS",
    "remax": "grpolab.algorithms.estimators:REMAX",
}
# algorithm.policy_loss: `fn(logp, old_logp, adv, mask, **opts) -> (loss (B, T), clip masks)` (algorithms/losses.py)
POLICY_LOSSES: dict[str, str] = {
    "clip": "grpolab.algorithms.losses:clip_loss",
    "gspo": "grpolab.algorithms.losses:gspo_loss",
    "reinforce": "grpolab.algorithms.losses:reinforce_loss",
    "cispo": "grpolab.algorithms.losses:cispo_loss",
}
# algorithm.kl_estimator: `fn(logp, ref_logp) -> (B, T)` (algorithms/kl.py)
KL_ESTIMATORS: dict[str, str] = {
    "k1": "grpolab.algorithms.kl:kl_k1",
    "k2": "grpolab.algorithms.kl:kl_k2",
    "k3": "grpolab.algorithms.kl:kl_k3",
}
# rollout.source: a RolloutSource class (rollout/source.py); 'workers' is not a rollout.source value:
# train.async_steps / rollout_workers pick it
SOURCES: dict[str, str] = {
    "builtin": "grpolab.rollout.builtin_source:BuiltinSource",
    "vllm": "grpolab.rollout.vllm_source:VLLMSource",
    "workers": "grpolab.rollout.worker_source:WorkerSource",
}
WORKERS = "workers"
# reward.functions: the built-in rewards (grpolab/rewards/); any other function is a spec with a ':' (rm:, judge:,
# verl:, package.module:function, path/to/file.py:function)
REWARDS: dict[str, str] = {
    "gsm8k_accuracy": "grpolab.rewards.accuracy:gsm8k_accuracy",
    "format": "grpolab.rewards.format:answer_format",
    "math_accuracy": "grpolab.rewards.accuracy:math_accuracy",
    "think_format": "grpolab.rewards.format:think_format",
    "boxed_format": "grpolab.rewards.format:boxed_format",
    "length": "grpolab.rewards.length:length",
    # runs the completion's program against the row's tests in a sandbox (grpolab/sandbox)
    "code_exec": "grpolab.rewards.code:code_exec",
    # intrinsic: read the current policy, no labels (rlpr reads the reference)
    "self_certainty": "grpolab.rewards.intrinsic:self_certainty",
    "token_entropy": "grpolab.rewards.intrinsic:token_entropy",
    "trajectory_logprob": "grpolab.rewards.intrinsic:trajectory_logprob",
    "rlpr": "grpolab.rewards.intrinsic:rlpr",
    # a reasoning-gym row's own scorer on the completion's <answer>; a verifiers task's own rubric
    "reasoning_gym": "grpolab.rewards.task_packages:reasoning_gym",
    "verifiers": "grpolab.rewards.task_packages:verifiers",
    # an episode's summed step rewards from its environment (env.name; rollout/env_decode.py)
    "env": "grpolab.rewards.environment:env",
}

# algorithm.scale_rewards (algorithms/advantages.py)
SCALE_REWARDS: tuple[str, ...] = ("group", "batch", "none")
# algorithm.loss_agg_mode (algorithms/aggregate.py)
AGG_MODES: tuple[str, ...] = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
# dpo.loss_type and distill.kl (algorithms/losses.py's dpo_loss and distill_kl; DPOConfig.loss_type in the Python API)
DPO_LOSSES: tuple[str, ...] = ("sigmoid", "ipo", "hinge", "robust")
DISTILL_KL: tuple[str, ...] = ("forward", "reverse")
# data.task: the prefixes of tasks whose rows and scorer come from a package (envs/reasoning_gym.py,
# envs/verifiers_env.py), each scored by the reward of the same name
REASONING_GYM_TASK = "reasoning_gym:"
VERIFIERS_TASK = "verifiers:"
PACKAGE_TASKS: tuple[str, ...] = (REASONING_GYM_TASK, VERIFIERS_TASK)


def load(table: dict[str, str], name: str, key: str) -> Any:
    """The function or class `table` declares for `name`, imported now; ConfigError naming the config `key` and
    the known names when `name` is not declared."""
    if name not in table:
        raise ConfigError(f"{key}: {name!r} is not one of {', '.join(table)}")
    module, _, attr = table[name].partition(":")
    return getattr(importlib.import_module(module), attr)
