"""A GRPO step's row of metrics.jsonl, over the global batch (every rank's rows; gather_rows is the identity
in one process). Names follow TRL's where it has them (reward, reward_std, frac_reward_zero_std,
rewards/<name>/mean, completions/mean_length, clip_ratio/*, entropy, kl)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from .. import distributed as dist
from ..rewards.combine import number_mean
from ..rollout.batch import RolloutBatch
from .batch_advantages import scorable

# the rollout sources' metrics in the order the rows have always had them; others follow
SOURCE_ORDER = ["time/generate", "async/weight_version", "async/staleness", "time/rollout_wait", "time/worker_idle",
                "time/weight_sync", "time/worker_start"]


def reward_metrics(batch: RolloutBatch, stats: dict, world: dist.World, name: Callable[[str], str]) -> dict:
    """reward, reward_std, frac_reward_zero_std and each function's mean and std (NaN rows left out)."""
    glob = dist.gather_rows
    r = glob(batch.rewards)[glob(scorable(batch))]
    # every rank has the same number of groups in its first round
    zero_std = dist.sum_floats(stats["frac_reward_zero_std"])[0] / world.size
    out = {"reward": float(r.mean()) if len(r) else float("nan"),
           "reward_std": float(r.std()) if len(r) > 1 else 0.0, "frac_reward_zero_std": zero_std}
    for spec, col in batch.reward_columns.items():
        col = glob(col)
        valid = col[~torch.isnan(col)]
        out[f"rewards/{name(spec)}/mean"] = float(valid.mean()) if len(valid) else float("nan")
        out[f"rewards/{name(spec)}/std"] = float(valid.std()) if len(valid) > 1 else 0.0
    return out


def logged_values(batch: RolloutBatch, logged_metrics: dict[str, list[float]],
                  world: dist.World) -> tuple[dict[str, list], dict[str, list[float]]]:
    """What reward functions logged this step, every rank's: the dict returns' extra keys (per row) and the
    log_metric scalars."""
    logged = {k: batch.logged[k] for k in batch.score_keys}
    if world.size == 1:
        return logged, logged_metrics
    parts = dist.gather_objects((logged, logged_metrics))
    logged = {k: [v for p, _ in parts for v in p.get(k, [])] for k in dict.fromkeys(k for p, _ in parts for k in p)}
    logged_metrics = {k: [v for _, m in parts for v in m.get(k, [])] for k in dict.fromkeys(
        k for _, m in parts for k in m)}
    return logged, logged_metrics


def step_metrics(step: int, batch: RolloutBatch, stats: dict, update: dict, kl: dict, logged_metrics: dict,
                 world: dist.World, name: Callable[[str], str], tools, num_iterations: int,
                 times: tuple[float, float, float, float]) -> dict:
    """The row of step `step`; `times`: the step's start, end of collection, end of advantages, end of update."""
    t0, t1, t2, t3 = times
    glob = dist.gather_rows
    lengths = glob(batch.gen.completion_mask.sum(-1).float().cpu())
    gen_tokens = float(lengths.sum())
    metrics = {"step": step, **reward_metrics(batch, stats, world, name)}
    logged, logged_metrics = logged_values(batch, logged_metrics, world)
    for key, values in logged.items():   # extra keys of dict returns (verl's reward_extra_info), means
        mean = number_mean(values)
        if mean is not None and key.rpartition("/")[2] not in ("mean", "std"):   # those name the reward's own
            metrics[f"rewards/{key}"] = mean
    metrics.update(update)
    metrics.update(kl)
    metrics.update({k: v for k, v in stats.items() if k.startswith(("dynamic_sampling/", "std_filter/"))})
    metrics["completions/mean_length"] = float(lengths.mean())
    metrics["completions/clipped_ratio"] = float(glob(batch.gen.truncated.float().cpu()).mean())
    if tools is not None:
        metrics.update(tools.metrics(batch.gen, glob))
    # the rollout source's own: time/generate, and e.g. async/*, time/rollout_wait, time/weight_sync
    source = {k: v for k, v in stats.items() if k.startswith(("time/", "async/")) and k != "time/reward"}
    metrics.update(sorted(source.items(), key=lambda kv: SOURCE_ORDER.index(kv[0]) if kv[0] in SOURCE_ORDER
                          else len(SOURCE_ORDER)))
    metrics["time/reward"] = stats["time/reward"]
    metrics["time/ref_and_advantages"] = t2 - t1
    metrics["time/update"] = t3 - t2
    metrics["time/step"] = t3 - t0
    metrics["perf/gen_tokens_per_sec"] = gen_tokens / max(stats["time/generate"], 1e-9)
    metrics["perf/train_tokens_per_sec"] = gen_tokens * num_iterations / max(t3 - t2, 1e-9)
    for k, v in logged_metrics.items():   # reward functions' log_metric scalars; built-in keys win
        if v:
            metrics.setdefault(k, sum(v) / len(v))
    return metrics
