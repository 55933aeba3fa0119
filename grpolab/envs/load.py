"""env.name -> the factory that makes one Environment per episode."""

from __future__ import annotations

from typing import Callable

from ..errors import ConfigError, RewardError
from ..rewards.custom import load_reward
from . import openenv_env, textarena_env
from .environment import Environment


def env_factory(spec: str) -> Callable[[], Environment]:
    """The per-episode factory `spec` names: 'openenv:<url>', 'textarena:<game id>', or 'module:fn' / 'file.py:fn'
    (a class works as its own factory; 'module:fn(key=value)' calls fn once with those arguments and uses what it
    returns)."""
    if spec.startswith(openenv_env.PREFIX):
        return openenv_env.factory(spec)
    if spec.startswith(textarena_env.PREFIX):
        return textarena_env.factory(spec)
    try:
        factory = load_reward(spec)
    except RewardError as e:
        raise ConfigError("env.name: " + str(e).replace(f"reward {spec!r}: ", f"{spec!r}: ")) from None
    return factory


def env_rows(spec: str, n: int, seed: int, system_prompt: str | None) -> list[dict]:
    """data.task=env: `n` rows {"prompt": the environment's first observation for the seed, "seed"}, seeds
    seed, seed+1, ...; the environment must have first_prompt(seed)."""
    make = env_factory(spec)
    rows = []
    for s in range(seed, seed + n):
        env = make()
        if not hasattr(env, "first_prompt"):
            raise ConfigError(f"data.task: env needs an environment that gives its first prompt (first_prompt(seed)); "
                              f"{spec} does not: give rows with prompts (data.task=files)")
        prompt = env.first_prompt(s)
        env.close()
        if system_prompt:
            prompt = [{"role": "system", "content": system_prompt}, *prompt]
        rows.append({"prompt": prompt, "seed": s})
    return rows
