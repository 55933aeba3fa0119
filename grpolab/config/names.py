"""The names config/validate.py checks keys against, as plain data: loading a config reads no
registry, so it imports no torch. Each tuple lists its registry's keys in the registry's order
(tests/test_config_names.py holds them equal)."""

from __future__ import annotations

# algorithm.adv_estimator: grpolab/algorithms/estimators.py's ADV_ESTIMATORS
ADV_ESTIMATORS: tuple[str, ...] = ("grpo", "dr_grpo", "rloo", "reinforce_baseline", "grpo_passk", "gae",
                                   "reinforce_plus_plus", "remax")
# rollout.engine: grpolab/rollout/sources.py's SOURCES, but 'workers' (train.async_steps/rollout_workers pick it)
ROLLOUT_ENGINES: tuple[str, ...] = ("builtin", "vllm")
# algorithm.scale_rewards: grpolab/algorithms/advantages.py's SCALE_REWARDS
SCALE_REWARDS: tuple[str, ...] = ("group", "batch", "none")
# algorithm.policy_loss: grpolab/algorithms/losses.py's POLICY_LOSSES
POLICY_LOSSES: tuple[str, ...] = ("clip", "gspo", "reinforce", "cispo")
# algorithm.kl_estimator: grpolab/algorithms/kl.py's KL_ESTIMATORS
KL_ESTIMATORS: tuple[str, ...] = ("k1", "k2", "k3")
# algorithm.loss_agg_mode: grpolab/algorithms/aggregate.py's AGG_MODES
AGG_MODES: tuple[str, ...] = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
# dpo.loss_type and distill.kl: grpolab/algorithms/losses.py's DPO_LOSSES and DISTILL_KL
DPO_LOSSES: tuple[str, ...] = ("sigmoid", "ipo", "hinge", "robust")
DISTILL_KL: tuple[str, ...] = ("forward", "reverse")
# data.task: the prefixes of tasks whose rows and scorer come from a package, each with the reward of the same
# name (grpolab/envs/reasoning_gym.py's and verifiers_env.py's TASK_PREFIX)
PACKAGE_TASKS: tuple[str, ...] = ("reasoning_gym:", "verifiers:")
# reward.functions: the built-in rewards, grpolab/rewards/__init__.py's REWARDS; any other function is a
# spec with a ':' (rm:, judge:, verl:, package.module:function, path/to/file.py:function)
REWARDS: tuple[str, ...] = ("gsm8k_accuracy", "format", "math_accuracy", "think_format", "boxed_format", "length",
                            "code_exec", "self_certainty", "token_entropy", "trajectory_logprob", "rlpr",
                            "reasoning_gym", "verifiers", "env")
