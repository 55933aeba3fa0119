"""What varies between RL runs, decided once when the trainer is built and never again inside a step:
is there a reference, where the KL term goes, which advantage estimator (and so: token-level or group,
a critic, greedy baselines), which rollout correction, whether a group's prompt is shared in log-prob
passes."""

from __future__ import annotations

from dataclasses import dataclass

from .. import distributed as dist
from ..algorithms.estimators import Estimator, get_estimator
from ..config import Config
from ..errors import ConfigError
from ..rewards import wants_policy


@dataclass(frozen=True)
class Plan:
    reference: str          # none | frozen (a frozen copy of the starting policy) | adapters_off (LoRA: the policy)
    kl: str                 # none | reward (beta * KL folded into the rewards) | loss (beta * KL added to the loss)
    estimator: Estimator    # algorithm.adv_estimator's registry entry (algorithms/estimators.py)
    correction: str         # algorithm.rollout_correction: none | tis | mis
    sharded: bool           # train.strategy=fsdp over several ranks: policy and reference sharded
    share_group: int        # G when each group's prompt goes through the model once per log-prob pass, else 0

    @property
    def critic(self) -> bool:
        return self.estimator.critic

    @property
    def kl_in_loss(self) -> bool:
        return self.kl == "loss"


def build_plan(cfg: Config, world_size: int, lora: bool) -> Plan:
    """The plan of `cfg` for a run over `world_size` ranks, with LoRA adapters on the policy or not."""
    a = cfg.algorithm
    # a group's prompt once per log-prob pass: two forwards per backward, which DDP and FSDP do not
    # allow, and a KV cache, which HF turns off under gradient checkpointing
    share = cfg.optim.share_prompt and world_size == 1 and not cfg.model.gradient_checkpointing
    return Plan(reference="none" if a.beta == 0 else ("adapters_off" if lora else "frozen"),
                kl="none" if a.beta == 0 else ("reward" if a.kl_in_reward else "loss"),
                estimator=get_estimator(a.adv_estimator), correction=a.rollout_correction,
                sharded=cfg.train.strategy == "fsdp" and world_size > 1,
                share_group=cfg.rollout.num_generations if share else 0)


def check_plan(cfg: Config, plan: Plan, world: dist.World) -> None:
    """What the plan cannot run (yet), one ConfigError line each."""
    if world.size > 1:
        problem = dist.check_world(world, cfg.rollout.prompts_per_step)
        if problem:
            raise ConfigError(problem)
        if cfg.rollout.source == "vllm" and not cfg.train.worker_count:   # vLLM here sets up a world of its own
            raise ConfigError("rollout.source: vllm runs in one process for now; drop --nproc or use "
                              "rollout.source=builtin")
        if plan.estimator.token_level:
            raise ConfigError(f"algorithm.adv_estimator: {cfg.algorithm.adv_estimator} (token-level, batch-whitened) "
                              f"runs in one process for now; drop --nproc or use a group estimator")
        if cfg.train.strategy == "fsdp" and any(wants_policy(f) for f in cfg.reward.functions):
            raise ConfigError("reward.functions: intrinsic rewards read the policy, which train.strategy=fsdp shards; "
                              "use train.strategy=ddp")
    if plan.estimator.greedy and any(wants_policy(f) for f in cfg.reward.functions):
        raise ConfigError(f"algorithm.adv_estimator: {cfg.algorithm.adv_estimator} scores a greedy completion per "
                          f"prompt, which intrinsic rewards (policy-reading) do not support yet; use another estimator")
