"""Reward functions, looked up by name.

Contract (TRL's): fn(prompts, completions, **columns) -> list[float | None]; dataset
columns arrive as keyword lists by name. None means "not applicable to this sample".
"""

from __future__ import annotations

from typing import Callable

from .answers import gsm8k_accuracy
from .format import answer_format

RewardFn = Callable[..., list]

REWARDS: dict[str, RewardFn] = {
    "gsm8k_accuracy": gsm8k_accuracy,
    "format": answer_format,
}


def get_reward(name: str) -> RewardFn:
    """The reward function registered under `name`."""
    try:
        return REWARDS[name]
    except KeyError:
        raise KeyError(f"unknown reward {name!r}; known rewards: {', '.join(sorted(REWARDS))}") from None
