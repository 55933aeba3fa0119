"""Learning-rate schedule shared by the GRPO loop and the supervised warm start."""

from __future__ import annotations

import math


def lr_factor(step: int, warmup: int, total: int, schedule: str, decay_start: int | None = None) -> float:
    """Multiplier on the peak lr at optimizer step `step` (0-based).

    Linear warmup: step s < warmup gets (s + 1) / warmup (the first step 1/warmup of the peak,
    the peak from step warmup - 1 on), multiplied by the decay. The decay (`schedule`: constant,
    linear or cosine) runs from `decay_start` (default: the end of the warmup, as in GRPO) to 0
    at step `total`. The warm start (sft.py) decays from step 0, over its warmup as well.
    """
    start = warmup if decay_start is None else decay_start
    warm = (step + 1) / warmup if warmup and step < warmup else 1.0
    if schedule == "constant" or total <= start:
        return warm
    progress = min(1.0, max(0.0, (step - start) / max(1, total - start)))
    if schedule == "linear":
        decay = 1.0 - progress
    elif schedule == "cosine":
        decay = 0.5 * (1.0 + math.cos(math.pi * progress))
    else:
        raise ValueError(f"unknown lr schedule {schedule!r}; use constant, linear or cosine")
    return warm * decay
