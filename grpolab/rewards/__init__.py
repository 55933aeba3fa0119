"""Reward functions, looked up by spec.

Contract (TRL's, see `calling`): fn(prompts=..., completions=..., completion_ids=..., **columns)
-> list[float | None], called by keyword; dataset columns arrive as lists by name. None means
"not applicable to this sample". Completions are strings, or one-message assistant turns when
the prompts are chat message lists; the built-in rewards accept both. Async functions
(`async def`) are allowed; `combine.score` runs them concurrently.

Spec forms accepted by `get_reward`:
  - a registered name (see REWARDS), e.g. 'math_accuracy'
  - 'rm:<local dir or hub id>': a reward model (`grpolab rm`'s, or a sequence classifier)
  - 'judge:<name>': an LLM judge behind an OpenAI-compatible API (reward.judges.<name>; `judge`)
  - 'package.module:function' or 'path/to/file.py:function': a user function (TRL's convention),
    optionally ending in a factory call with literal arguments: 'module:get_reward(max_len=64)'
  - 'verl:<module or file.py>:function': a verl compute_score (see `verl_style`)
"""

from __future__ import annotations

import re
from typing import Callable

from ..config import names
from ..errors import RewardError, UnknownRewardError
from .custom import load_reward, parse_call
from .judge import get_judge
from .length import make_length_reward
from .model import reward_model
from .verl_style import verl_reward

RewardFn = Callable[..., list]

# the built-in rewards by name: config/names.py's REWARDS, loaded here once (callers use the functions themselves)
REWARDS: dict[str, RewardFn] = {name: names.load(names.REWARDS, name, "reward.functions") for name in names.REWARDS}


# functions handed over in Python (grpolab.GRPOTrainer(reward_funcs=[fn])) that no module spec can import, by
# their 'python:<name>' spec; they live as long as the process
PASSED: dict[str, RewardFn] = {}


def wants_policy(spec: str) -> bool:
    """Whether the reward function takes the `policy` argument (an intrinsic reward)."""
    import inspect
    try:
        return "policy" in inspect.signature(get_reward(spec)).parameters
    except (TypeError, ValueError):
        return False

__all__ = ["PASSED", "REWARDS", "RewardError", "RewardFn", "UnknownRewardError", "get_reward", "make_length_reward",
           "reward_name", "reward_names", "wants_policy"]


def get_reward(spec: str) -> RewardFn:
    """The reward function for `spec`: a REWARDS name, 'rm:<model>', 'module:fn', 'file.py:fn' or 'verl:...'.

    Loaded models and files are cached, so calling this every step is cheap.
    Raises UnknownRewardError (a RewardError and KeyError) for an unknown name and
    RewardError when a model or function cannot be loaded.
    """
    if spec in REWARDS:
        return REWARDS[spec]
    if spec in PASSED:
        return PASSED[spec]
    if spec.startswith("rm:"):
        return reward_model(spec[len("rm:"):])
    if spec.startswith("judge:"):
        return get_judge(spec)
    if spec.startswith("verl:"):
        return verl_reward(spec)
    if ":" in spec:
        return load_reward(spec)
    raise UnknownRewardError(
        f"unknown reward {spec!r}; known rewards: {', '.join(sorted(REWARDS))}; or give "
        f"'package.module:function', 'path/to/file.py:function', 'verl:path/to/file.py:compute_score' "
        f"or 'rm:<model dir or hub id>'")


def reward_name(spec: str) -> str:
    """Short metric-friendly name: the registered name, the function of 'x:fn' or 'verl:x:fn', the
    __name__ of the function a factory spec 'x:factory(...)' makes (TRL's metric name; the factory's
    name when it cannot be made), or 'rm_<last path part>'."""
    if spec in REWARDS:
        name = spec
    elif spec.startswith("rm:"):
        name = "rm_" + re.split(r"[/\\]", spec[len("rm:"):].rstrip("/\\"))[-1]
    elif spec.startswith("judge:"):
        name = "judge_" + spec[len("judge:"):]
    elif ":" in spec:
        name = _spec_parts(spec)[1]
        if spec.endswith(")") and not spec.startswith("verl:"):
            try:
                name = getattr(get_reward(spec), "__name__", name)
            except RewardError:
                pass
    else:
        name = spec
    # metric keys are 'rewards/<name>/mean': keep them free of slashes and spaces
    return re.sub(r"[^\w.\-]", "_", name) or "reward"


def _spec_parts(spec: str) -> tuple[str, str]:
    """(module or file stem, function) of a 'x:fn', 'x:fn(...)' or 'verl:x:fn' spec."""
    base = spec[len("verl:"):] if spec.startswith("verl:") else spec
    try:
        base = parse_call(base)[0]
    except RewardError:
        pass
    target, _, fn = base.rpartition(":")
    stem = re.split(r"[/\\]", target)[-1]
    return (stem[:-3] if stem.endswith(".py") else stem.rpartition(".")[2]), fn


def reward_names(specs: list[str]) -> dict[str, str]:
    """{spec: metric name} with names made unique: two functions both called compute_score become
    '<module or file>.compute_score'; names still equal get '_2', '_3', ... in order."""
    names = {s: reward_name(s) for s in specs}
    seen: dict[str, int] = {}
    for s in specs:
        seen[names[s]] = seen.get(names[s], 0) + 1
    for s in specs:
        if seen[names[s]] > 1 and ":" in s and not s.startswith("rm:"):
            stem, fn = _spec_parts(s)
            names[s] = re.sub(r"[^\w.\-]", "_", f"{stem}.{fn}")
    out, used = {}, set()
    for s in specs:
        name, k = names[s], 2
        while name in used:
            name, k = f"{names[s]}_{k}", k + 1
        out[s] = name
        used.add(name)
    return out
