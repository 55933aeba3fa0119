"""Named algorithm presets: full dotted config keys -> values, one dict per published recipe.

Every preset sets every key in PRESET_KEYS, so applying one fully determines the algorithm
whatever was set before (YAML / CLI overrides applied afterwards still win). Keys that the
config must provide (config/validate.py checks them against config/names.py):

    algorithm.adv_estimator              names.ADV_ESTIMATORS name
    algorithm.scale_rewards              group | batch | none (grpo / grpo_passk)
    algorithm.policy_loss                names.POLICY_LOSSES name
    algorithm.epsilon                    lower clip range
    algorithm.epsilon_high               upper clip range (None = epsilon)
    algorithm.clip_ratio_c               dual-clip bound (None = off)
    algorithm.beta                       KL-in-loss coefficient (0 = no reference model)
    algorithm.kl_estimator               k1 | k2 | k3
    algorithm.loss_agg_mode              names.AGG_MODES name
    algorithm.num_iterations             optimizer passes per rollout batch (mu)
    algorithm.dynamic_sampling           DAPO: drop groups whose rewards are all equal
    algorithm.overlong_buffer            DAPO soft overlong punishment buffer, in tokens (0 = off)
    algorithm.overlong_penalty           its maximum penalty (reached at rollout.max_new_tokens)
    algorithm.mask_truncated_completions drop completions cut at max_new_tokens from the loss
    algorithm.gamma, algorithm.lam       token-level estimators: discount, GAE's lambda
"""

from __future__ import annotations

import copy

PRESET_KEYS: tuple[str, ...] = (
    "algorithm.adv_estimator", "algorithm.scale_rewards", "algorithm.policy_loss", "algorithm.epsilon",
    "algorithm.epsilon_high", "algorithm.clip_ratio_c", "algorithm.beta", "algorithm.kl_estimator",
    "algorithm.loss_agg_mode", "algorithm.num_iterations", "algorithm.dynamic_sampling",
    "algorithm.overlong_buffer", "algorithm.overlong_penalty", "algorithm.mask_truncated_completions",
    "algorithm.gamma", "algorithm.lam",
)

# Shared "off" values; each preset overrides what its paper changes.
_BASE: dict = {
    "algorithm.adv_estimator": "grpo",
    "algorithm.scale_rewards": "group",
    "algorithm.policy_loss": "clip",
    "algorithm.epsilon": 0.2,
    "algorithm.epsilon_high": None,
    "algorithm.clip_ratio_c": None,
    "algorithm.beta": 0.0,
    "algorithm.kl_estimator": "k3",
    "algorithm.loss_agg_mode": "token-mean",
    "algorithm.num_iterations": 1,
    "algorithm.dynamic_sampling": False,
    "algorithm.overlong_buffer": 0,
    "algorithm.overlong_penalty": 1.0,
    "algorithm.mask_truncated_completions": False,
    "algorithm.gamma": 1.0,
    "algorithm.lam": 0.95,
}

PRESETS: dict[str, dict] = {
    # GRPO, Shao et al. 2024, "DeepSeekMath" (arXiv:2402.03300): z-scored group advantages,
    # PPO clip 0.2, k3 KL in the loss with beta 0.04, per-sequence mean of per-token means.
    # One policy update per rollout batch (mu = 1) as in its experiments.
    "grpo": {**_BASE, "algorithm.scale_rewards": "group", "algorithm.beta": 0.04,
             "algorithm.kl_estimator": "k3", "algorithm.loss_agg_mode": "seq-mean-token-mean"},
    # Dr. GRPO, Liu et al. 2025, "Understanding R1-Zero-Like Training" (arXiv:2503.20783): no std
    # scaling of advantages, no length normalization (token sum over a constant), no KL.
    "dr_grpo": {**_BASE, "algorithm.adv_estimator": "dr_grpo", "algorithm.scale_rewards": "none",
                "algorithm.loss_agg_mode": "seq-mean-token-sum-norm"},
    # DAPO, Yu et al. 2025 (arXiv:2503.14476): clip-higher (0.2 / 0.28), token-level mean, no KL,
    # dynamic sampling, soft overlong punishment. DAPO used a 4096-token buffer with a 20480-token
    # cap (a fifth of it); 8 tokens suits this repo's short completions (rollout.max_new_tokens 32).
    "dapo": {**_BASE, "algorithm.epsilon": 0.2, "algorithm.epsilon_high": 0.28,
             "algorithm.loss_agg_mode": "token-mean", "algorithm.dynamic_sampling": True,
             "algorithm.overlong_buffer": 8, "algorithm.overlong_penalty": 1.0,
             "algorithm.mask_truncated_completions": False},
    # GSPO, Zheng et al. 2025, "Group Sequence Policy Optimization" (arXiv:2507.18071): sequence-level
    # ratio clipped to [1 - 3e-4, 1 + 4e-4], no KL, seq-mean-token-mean. The paper splits each
    # rollout batch into 4 mini-batches, so updates are off-policy; with mu = 1 the ratio is exactly
    # 1 and GSPO's gradient equals GRPO's, hence two passes here.
    "gspo": {**_BASE, "algorithm.policy_loss": "gspo", "algorithm.epsilon": 3e-4,
             "algorithm.epsilon_high": 4e-4, "algorithm.loss_agg_mode": "seq-mean-token-mean",
             "algorithm.num_iterations": 2},
    # RLOO, Ahmadian et al. 2024, "Back to Basics" (arXiv:2402.14740): leave-one-out baseline,
    # REINFORCE on the whole sequence's log-prob (token sum, mean over sequences). With mu = 1 the
    # clip loss has ratio 1, so its gradient is exactly the on-policy REINFORCE gradient. The paper
    # puts a KL penalty in the reward (kl.apply_kl_in_reward); here beta = 0.
    "rloo": {**_BASE, "algorithm.adv_estimator": "rloo", "algorithm.scale_rewards": "none",
             "algorithm.loss_agg_mode": "seq-mean-token-sum"},
    # nanochat (Karpathy 2025, chat_rl.py): on-policy REINFORCE, A = r - group mean, loss
    # -A * logp averaged over all completion tokens, no ratio, no clipping, no KL.
    "reinforce": {**_BASE, "algorithm.adv_estimator": "dr_grpo", "algorithm.scale_rewards": "none",
                  "algorithm.policy_loss": "reinforce", "algorithm.loss_agg_mode": "token-mean"},
    # PPO (Schulman et al. 2017) as RLHF runs it (Ouyang et al. 2022; verl's and TRL's PPO): a learned
    # critic, GAE (gamma 1, lambda 0.95) over token rewards, advantages whitened over the batch's
    # tokens, clip 0.2, token-mean; two passes so the clip has something to clip. No KL here (set
    # algorithm.beta and algorithm.kl_in_reward for the classic per-token KL shaping); critic.* for
    # the critic.
    "ppo": {**_BASE, "algorithm.adv_estimator": "gae", "algorithm.loss_agg_mode": "token-mean",
            "algorithm.num_iterations": 2, "algorithm.gamma": 1.0, "algorithm.lam": 0.95},
}


def apply_preset(name: str) -> dict:
    """A fresh copy of preset `name` (dotted key -> value); ValueError listing the known presets."""
    try:
        return copy.deepcopy(PRESETS[name])
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; known: {', '.join(PRESETS)}") from None
