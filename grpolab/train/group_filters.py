"""Which groups of a scored batch train: DAPO's dynamic sampling keeps the groups whose rewards differ;
RLPR's std filter drops the groups whose reward std is below a moving average of earlier batches'."""

from __future__ import annotations

import torch

from .. import distributed as dist
from ..algorithms.shaping import dynamic_sampling_keep
from ..rollout.batch import RolloutBatch
from .batch_advantages import scorable


def informative(batch: RolloutBatch) -> torch.Tensor:
    """(B,) bool: rows of the groups whose scorable rewards are not all equal (DAPO's filter)."""
    ok = scorable(batch)
    varied = torch.zeros(len(batch), dtype=torch.bool)
    varied[ok] = dynamic_sampling_keep(batch.rewards[ok], batch.group_ids[ok])
    return torch.isin(batch.group_ids, batch.group_ids[varied])


def zero_std(batch: RolloutBatch) -> float:
    """Share of groups whose scorable rewards are all equal (or that have at most one)."""
    _, inv = torch.unique(batch.group_ids, return_inverse=True)
    ok = scorable(batch)
    groups = [batch.rewards[(inv == g) & ok] for g in range(int(inv.max()) + 1)]
    return sum(float(len(r) < 2 or r.max() == r.min()) for r in groups) / len(groups)


def std_filter(batch: RolloutBatch, decay: float, ema: float | None, stats: dict) -> tuple[RolloutBatch, float | None]:
    """RLPR's filter (algorithm.std_filter_ema = decay > 0): drop the groups whose reward std is below `ema`,
    the moving average of earlier batches' mean group std (the first batch sets it and keeps all). Returns
    the batch and the average with this batch taken in. A batch that would lose every group keeps them all."""
    if not decay:
        return batch, ema
    _, inv = torch.unique(batch.group_ids, return_inverse=True)
    ok = scorable(batch)
    stds = torch.stack([batch.rewards[(inv == g) & ok].std(unbiased=False) if int(((inv == g) & ok).sum()) > 1
                        else torch.tensor(0.0) for g in range(int(inv.max()) + 1)])
    total, count = dist.sum_floats(float(stds.sum()), float(len(stds)))   # every rank: the same average
    keep = stds >= ema if ema is not None else torch.ones_like(stds, dtype=torch.bool)
    new_ema = total / count if ema is None else decay * ema + (1 - decay) * total / count
    stats["std_filter/threshold"] = ema if ema is not None else 0.0
    stats["std_filter/kept_groups"] = dist.sum_floats(float(keep.sum()))[0]
    return (batch.select(keep[inv]) if keep.any() else batch), new_ema
