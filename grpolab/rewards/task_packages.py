"""Rewards that are a task package's own scorer: reasoning-gym's `score_answer` and a verifiers task's rubric
(the packages' rows and scorers: envs/reasoning_gym.py, envs/verifiers_env.py)."""

from __future__ import annotations

from ..envs import reasoning_gym as rg
from ..envs import verifiers_env
from .calling import completion_texts


def reasoning_gym(completions: list, reasoning_gym: list[dict], **_) -> list[float | None]:
    """The row's reasoning-gym scorer on the completion's last <answer> (None for rows that are not its)."""
    return [rg.score(entry, text) for entry, text in zip(reasoning_gym, completion_texts(completions))]


async def verifiers(prompts: list, completions: list, verifiers: list, **_) -> list[float | None]:
    """The row's verifiers task scores the completion (None for rows that are not a task's)."""
    return [await verifiers_env.score(task, prompt, text)
            for prompt, text, task in zip(prompts, completion_texts(completions), verifiers)]
