"""Reward functions, looked up by spec.

Contract (TRL's): fn(prompts, completions, **columns) -> list[float | None]; dataset
columns arrive as keyword lists by name. None means "not applicable to this sample".
Prompts are strings or chat message lists; completions are strings. Async functions
(`async def`) are allowed; `combine.score` runs them concurrently.

Spec forms accepted by `get_reward`:
  - a registered name (see REWARDS), e.g. 'math_accuracy'
  - 'rm:<local dir or hub id>': a sequence-classification reward model
  - 'package.module:function' or 'path/to/file.py:function': a user function
"""

from __future__ import annotations

import re
from typing import Callable

from .answers import gsm8k_accuracy
from .errors import RewardError, UnknownRewardError
from .format import answer_format, think_format
from . import length as _length  # not `from .length import length`: keep rewards.length the module
from .length import make_length_reward
from .math_answers import math_accuracy

RewardFn = Callable[..., list]

REWARDS: dict[str, RewardFn] = {
    "gsm8k_accuracy": gsm8k_accuracy,
    "format": answer_format,
    "math_accuracy": math_accuracy,
    "think_format": think_format,
    "length": _length.length,
}

__all__ = ["REWARDS", "RewardError", "RewardFn", "UnknownRewardError", "get_reward", "make_length_reward",
           "reward_name"]


def get_reward(spec: str) -> RewardFn:
    """The reward function for `spec`: a REWARDS name, 'rm:<model>', 'module:fn' or 'file.py:fn'.

    Loaded models and files are cached, so calling this every step is cheap.
    Raises UnknownRewardError (a RewardError and KeyError) for an unknown name and
    RewardError when a model or function cannot be loaded.
    """
    if spec in REWARDS:
        return REWARDS[spec]
    if spec.startswith("rm:"):
        from .model import reward_model
        return reward_model(spec[len("rm:"):])
    if ":" in spec:
        from .custom import load_function
        return load_function(spec)
    raise UnknownRewardError(
        f"unknown reward {spec!r}; known rewards: {', '.join(sorted(REWARDS))}; or give "
        f"'package.module:function', 'path/to/file.py:function', or 'rm:<model dir or hub id>'")


def reward_name(spec: str) -> str:
    """Short metric-friendly name: the registered name, the function of 'x:fn', or 'rm_<last path part>'."""
    if spec in REWARDS:
        name = spec
    elif spec.startswith("rm:"):
        name = "rm_" + re.split(r"[/\\]", spec[len("rm:"):].rstrip("/\\"))[-1]
    elif ":" in spec:
        name = spec.rpartition(":")[2]
    else:
        name = spec
    # metric keys are 'rewards/<name>/mean': keep them free of slashes and spaces
    return re.sub(r"[^\w.\-]", "_", name) or "reward"
