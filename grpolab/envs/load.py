"""env.name -> the factory that makes one Environment per episode."""

from __future__ import annotations

from typing import Callable

from ..errors import ConfigError, EnvError, RewardError
from ..rewards.custom import load_reward
from . import openenv_env, textarena_env
from .calls import call_envs
from .environment import Environment, check_messages


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


def env_rows(spec: str, n: int, seed: int, system_prompt: str | None, timeout: float = 30.0) -> list[dict]:
    """data.task=env: `n` rows {"prompt": the environment's first observation for the seed, "seed"}, seeds
    seed, seed+1, ...; the environment must have first_prompt(seed). Each seed's environment is made, asked and
    closed as an episode's is (envs/calls.py: within `timeout` seconds, os._exit guarded), one seed at a time (a
    package may seed a global generator: textarena's games do), and its prompt must be chat messages (or a text)."""
    make = env_factory(spec)
    rows = []
    for s in range(seed, seed + n):
        at = _Stage(f"making the environment for seed {s}")
        (prompt,) = call_envs(spec, [lambda s=s, at=at: _first_prompt(make, s, at)], [at], timeout)
        if prompt is _NO_FIRST_PROMPT:
            raise ConfigError(f"data.task: env needs an environment that gives its first prompt (first_prompt(seed)); "
                              f"{spec} does not: give rows with prompts (data.task=files)")
        where = f"environment {spec}: first_prompt({s})"
        if prompt is None:
            raise EnvError(f"{where} returned None, not a prompt (a list of {{role, content}} messages, or a text)")
        prompt = check_messages(prompt, where, "the prompt")
        if not prompt:
            raise EnvError(f"{where} returned no message")
        if system_prompt:
            prompt = [{"role": "system", "content": system_prompt}, *prompt]
        rows.append({"prompt": prompt, "seed": s})
    return rows


_NO_FIRST_PROMPT = object()


class _Stage:
    """How far one seed's calls got, for the line that names a failure (read when one fails)."""

    def __init__(self, text: str) -> None:
        self.text = text

    def __str__(self) -> str:
        return self.text


def _first_prompt(make: Callable[[], Environment], s: int, at: _Stage) -> object:
    env = make()
    if not hasattr(env, "first_prompt"):
        return _NO_FIRST_PROMPT
    at.text = f"first_prompt({s})"
    prompt = env.first_prompt(s)
    at.text = f"close after first_prompt({s})"
    env.close()
    return prompt
