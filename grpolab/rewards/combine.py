"""Score completions with several reward functions and combine them with weights."""

from __future__ import annotations

import math

import torch

from . import get_reward


class RewardError(RuntimeError):
    """A reward function failed or returned something unusable; the message names it."""


def score(names: list[str], weights: list[float] | None, prompts: list[str], completions: list[str],
          columns: dict[str, list]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(total (B,), {name: (B,)}) for the reward functions `names`.

    A None from a function means "not applicable": it shows as NaN in that function's
    column and adds nothing to the total (TRL's convention).
    """
    weights = weights or [1.0] * len(names)
    n = len(completions)
    total = torch.zeros(n, dtype=torch.float32)
    per_fn: dict[str, torch.Tensor] = {}
    for name, w in zip(names, weights):
        fn = get_reward(name)
        try:
            values = fn(prompts, completions, **columns)
        except Exception as e:  # noqa: BLE001 - re-raised with the function's name
            raise RewardError(f"reward function {name!r} raised {type(e).__name__}: {e}") from e
        if not isinstance(values, (list, tuple)) or len(values) != n:
            got = len(values) if isinstance(values, (list, tuple)) else type(values).__name__
            raise RewardError(f"reward function {name!r} returned {got} values for {n} completions; "
                              f"return one float (or None) per completion")
        col = torch.full((n,), float("nan"))
        for i, v in enumerate(values):
            if v is None:
                continue
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise RewardError(f"reward function {name!r} returned {v!r} for sample {i}; "
                                  f"return a finite float or None")
            col[i] = float(v)
        per_fn[name] = col
        total += w * torch.nan_to_num(col, nan=0.0)
    return total, per_fn
