"""One step's scored batch from the rollout source. With dynamic sampling (DAPO), groups whose rewards are
all equal are dropped and more prompts sampled, up to algorithm.max_sampling_rounds rounds; the batch is
then cut to rollout.prompts_per_step groups. With several ranks each rank keeps up to its share of the
groups, and all ranks take the same number of rounds."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .. import distributed as dist
from ..config.schema import AlgorithmConfig
from ..monitor.console import StepProgress
from ..rollout.batch import RolloutBatch, cat_batches
from ..rollout.source import RolloutSource
from .group_filters import informative, std_filter, zero_std


@dataclass
class Collected:
    batch: RolloutBatch
    stats: dict[str, float]                 # time/generate, time/reward, the source's metrics, the filters'
    epoch: float                            # the prompts' passes before this step
    logged: dict[str, list[float]] = field(default_factory=dict)   # reward functions' log_metric values
    std_ema: float | None = None            # RLPR's moving average, this batch taken in


def collect(source: RolloutSource, step: int, score: Callable[[RolloutBatch, float], dict[str, list[float]]],
            a: AlgorithmConfig, groups: int, world: dist.World, pad_id: int, progress: StepProgress,
            std_ema: float | None) -> Collected:
    """`score(batch, epoch)` scores a batch in place and returns what the functions logged; `groups`: this
    rank's share of rollout.prompts_per_step."""
    out = Collected(None, {"time/generate": 0.0, "time/reward": 0.0}, 0.0)
    kept: list[RolloutBatch] = []
    n_groups, first = 0, None
    for rnd in range(1, a.max_sampling_rounds + 1):
        taken = source.take(step)
        t1 = time.perf_counter()
        batch = taken.batch
        if first is None:
            out.epoch, first = taken.epoch, batch
        for k, v in taken.metrics.items():   # times add up over rounds
            out.stats[k] = out.stats.get(k, 0.0) + v if k.startswith("time/") else v
        progress.start_phase("score", len(batch))
        for k, v in score(batch, out.epoch).items():
            out.logged.setdefault(k, []).extend(v)
        out.stats["time/reward"] += time.perf_counter() - t1
        if not a.dynamic_sampling:
            out.stats["frac_reward_zero_std"] = zero_std(batch)
            out.batch, out.std_ema = std_filter(batch, a.std_filter_ema, std_ema, out.stats)
            return out
        keep = informative(batch)
        kept.append(batch.select(keep))
        n_groups += len(torch.unique(batch.group_ids[keep]))
        done = n_groups >= groups
        if world.size > 1:   # another round until every rank has its share
            done = dist.sum_floats(float(done))[0] == world.size
        if done:
            break
    out.stats["dynamic_sampling/rounds"] = rnd
    out.stats["dynamic_sampling/kept_groups"] = dist.sum_floats(float(min(n_groups, groups)))[0] \
        if world.size > 1 else min(n_groups, groups)
    out.stats["frac_reward_zero_std"] = zero_std(first)   # of the first round, before filtering
    if n_groups > 0:
        merged = cat_batches(kept, pad_id)
        batch = merged.select(merged.group_ids < groups)
    # (nothing informative within the cap: train on the last round, whose advantages are zero)
    out.batch, out.std_ema = std_filter(batch, a.std_filter_ema, std_ema, out.stats)
    return out
