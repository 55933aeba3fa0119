"""The environment contract: what grpolab asks of an environment that replies between a model's turns.

    env = make_env()                 one Environment per episode (a fresh object: episodes share no state)
    env.reset(row)                   the episode starts from a dataset row; its first prompt is row["prompt"]
    reply = env.step(text)           the model's turn, as text -> Reply(messages, reward, done)
    env.close()

The rollout engine drives episodes turn by turn on one token stream (rollout/env_decode.py): a turn ends when
the model samples its end-of-turn token; the environment's reply messages are rendered once through the chat
template and appended (`turns.TurnRenderer`); the next turn is sampled after them. The episode ends when the
environment says done, after env.max_turns turns, or when the episode's tokens reach rollout.max_completion_tokens.
An episode's reward is the sum of its steps' rewards (the `env` reward function reads it).

env.name names the factory (load.py): 'package.module:make_env' or 'path/to/file.py:make_env', optionally called
with literal arguments 'module:make_env(level=2)' (the call returns the factory); 'openenv:<base url>' and
'textarena:<game id>' are the adapters (envs/openenv_env.py, envs/textarena_env.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..data.messages import canonical_role, role_problem
from ..errors import EnvError


@dataclass
class Reply:
    """The environment's answer to one model turn."""
    messages: list[dict] = field(default_factory=list)   # {role, content}: what the model reads next
    reward: float = 0.0
    done: bool = False


class Environment:
    """Subclass and give `step` (and `reset`, when the episode has state): one object per episode."""

    def reset(self, row: dict) -> None:
        """Start the episode of `row` (the dataset row whose prompt the model has read)."""

    def step(self, text: str) -> Reply:
        raise NotImplementedError

    def close(self) -> None:
        pass


def check_reply(reply: object, where: str) -> Reply:
    """`reply` as a Reply, or EnvError naming `where` and what is wrong with it."""
    if isinstance(reply, tuple) and len(reply) == 3:   # (messages, reward, done)
        reply = Reply(*reply)
    if not isinstance(reply, Reply):
        raise EnvError(f"{where}: step() returned a {type(reply).__name__}, not a Reply(messages, reward, done)")
    try:
        reward = float(reply.reward)
    except (TypeError, ValueError):
        raise EnvError(f"{where}: the reward {reply.reward!r} is not a number") from None
    if not math.isfinite(reward):
        raise EnvError(f"{where}: the reward is {reward}, not a finite number")
    msgs = check_messages(reply.messages, where, "the reply's messages")
    if not reply.done and not msgs:
        raise EnvError(f"{where}: the episode goes on but the reply has no message for the model")
    return Reply(msgs, reward, bool(reply.done))


def check_messages(msgs: object, where: str, what: str) -> list[dict]:
    """`msgs` (a list of {role, content}, one such dict, or a text: a user message) as a list of messages with chat
    roles (developer rendered as system); EnvError naming `where` and `what` when it is none of those, or a role
    is not a chat role (the rule training data and the server apply: data/messages.py)."""
    if isinstance(msgs, dict):
        msgs = [msgs]
    if isinstance(msgs, str):
        msgs = [{"role": "user", "content": msgs}]
    if not isinstance(msgs, list) or not all(isinstance(m, dict) and isinstance(m.get("role"), str)
                                             and isinstance(m.get("content"), str) for m in msgs):
        raise EnvError(f"{where}: {what} must be a list of {{role, content}} with text content, got {str(msgs)[:80]}")
    for m in msgs:
        problem = role_problem(m["role"])
        if problem:
            raise EnvError(f"{where}: {what}: {problem}")
    return [{**m, "role": canonical_role(m["role"])} for m in msgs]
