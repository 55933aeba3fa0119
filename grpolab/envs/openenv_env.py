"""OpenEnv environments (openenv-core): an environment server spoken to over its WebSocket session, one per
episode.

    env.name: openenv:http://127.0.0.1:8000       each turn's text is the action {"message": text}
    env.name: my_envs.py:make_env                   OpenEnvEnvironment(url, action=..., observe=...) for others

reset(row) resets the server's environment with the row's seed; step(text) sends the action and turns the
observation into the model's next message (`observe`: its text field, else the observation as JSON), with the
step's reward (None counts 0) and done. With data.task=env the rows are the environment's first observations,
one per seed, so the server must give the same first observation for the same seed (checked at every reset).
"""

from __future__ import annotations

import json
from typing import Callable

from ..errors import ConfigError, EnvError
from .environment import Environment, Reply

PREFIX = "openenv:"
TEXT_FIELDS = ("message", "text", "prompt", "feedback", "observation")


def _client_class():
    try:
        from openenv.core import GenericEnvClient
    except ImportError:
        raise ConfigError("env.name: openenv: environments need openenv-core; pip install 'grpolab[envs]'") from None
    return GenericEnvClient


def message_action(text: str) -> dict:
    """The default action: the turn's text as {"message": text}."""
    return {"message": text}


def observation_text(observation: dict) -> str:
    """The model's view of an observation: its one text field (message, text, prompt, feedback, observation),
    else the observation as JSON."""
    for key in TEXT_FIELDS:
        if isinstance(observation.get(key), str):
            return observation[key]
    return json.dumps(observation, sort_keys=True)


class OpenEnvEnvironment(Environment):
    """One episode on an OpenEnv server at `base_url`."""

    def __init__(self, base_url: str, action: Callable[[str], dict] = message_action,
                 observe: Callable[[dict], str] = observation_text) -> None:
        self.base_url, self.action, self.observe = base_url, action, observe
        self.client = None

    def first_prompt(self, seed: int) -> list[dict]:
        with _client_class()(base_url=self.base_url).sync() as client:
            return [{"role": "user", "content": self.observe(client.reset(seed=seed).observation)}]

    def reset(self, row: dict) -> None:
        self.client = _client_class()(base_url=self.base_url).sync()
        self.client.connect()
        first = self.observe(self.client.reset(seed=row.get("seed")).observation)
        said = row["prompt"][-1]["content"] if isinstance(row.get("prompt"), list) else None
        if "seed" in row and said is not None and first != said:
            raise EnvError(f"environment {self.base_url}: reset(seed={row['seed']}) gave another first observation "
                           f"than the row's prompt; the server's reset must be deterministic for a seed")

    def step(self, text: str) -> Reply:
        result = self.client.step(self.action(text))
        done = bool(result.done)
        return Reply([] if done else [{"role": "user", "content": self.observe(result.observation)}],
                     0.0 if result.reward is None else result.reward, done)

    def close(self) -> None:
        if self.client is not None:
            self.client.close()


def factory(spec: str) -> Callable[[], Environment]:
    """'openenv:<base url>' -> a factory of OpenEnvEnvironment episodes with the default action and view."""
    url = spec[len(PREFIX):]
    if not url.startswith(("http://", "https://", "ws://", "wss://")):
        raise ConfigError(f"env.name: {spec!r}: give the server's base URL, e.g. openenv:http://127.0.0.1:8000")
    _client_class()
    return lambda: OpenEnvEnvironment(url)
