"""env.name -> the factory that makes one Environment per episode."""

from __future__ import annotations

from typing import Callable

from ..errors import ConfigError, RewardError
from ..rewards.custom import load_reward
from .environment import Environment


def env_factory(spec: str) -> Callable[[], Environment]:
    """The per-episode factory `spec` names: 'module:fn' / 'file.py:fn' (a class works as its own factory;
    'module:fn(key=value)' calls fn once with those arguments and uses what it returns)."""
    try:
        factory = load_reward(spec)
    except RewardError as e:
        raise ConfigError("env.name: " + str(e).replace(f"reward {spec!r}: ", f"{spec!r}: ")) from None
    return factory
