"""Length reward: closeness of a completion's length to a target (smoltldr GRPO example)."""

from __future__ import annotations

from typing import Callable

from .calling import completion_texts

DEFAULT_TARGET = 50


def length(prompts, completions, target_length: int = DEFAULT_TARGET, **_) -> list[float]:
    """-|len(completion) - target_length| / target_length, lengths in characters.

    0.0 at the target, -1.0 for an empty completion; unbounded below for long ones.
    `target_length` can come from a dataset column of that name (TRL passes columns as
    per-sample lists), from a keyword, or from `make_length_reward`.
    """
    completions = completion_texts(completions)
    targets = target_length if isinstance(target_length, (list, tuple)) else [target_length] * len(completions)
    out = []
    for c, t in zip(completions, targets):
        if not t or t <= 0:
            raise ValueError(f"target_length must be > 0, got {t!r}")
        out.append(-abs(len(c) - t) / t)
    return out


def make_length_reward(target: int) -> Callable[..., list[float]]:
    """A `length` reward with a fixed target of `target` characters (ignores any target_length column)."""
    if target <= 0:
        raise ValueError(f"target must be > 0, got {target!r}")

    def length_reward(prompts, completions, **_) -> list[float]:
        return length(prompts, completions, target_length=target)

    length_reward.__name__ = f"length_{target}"
    length_reward.__doc__ = f"-|len(completion) - {target}| / {target} (characters)."
    return length_reward
