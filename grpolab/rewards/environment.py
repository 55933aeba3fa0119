"""The `env` reward: an episode's score from its environment (rollout/env_decode.py records it)."""

from __future__ import annotations


def env(completions: list, episode: list[dict] | None = None, **_) -> list[float | None]:
    """The sum of the episode's step rewards; None for rows that ran in no environment."""
    if episode is None:
        return [None] * len(completions)
    return [None if not isinstance(e, dict) else float(sum(e["rewards"])) for e in episode]
