"""TextArena games (textarena), single-player, as environments.

    env.name: textarena:GuessTheNumber-v0        data.task: env (the rows are the games' first observations)

reset(row) makes the game and resets it with the row's seed (its first observation must be the row's prompt:
checked); step(text) plays the turn; the game's messages since then are the model's next message. When the
game ends, the step's reward is the player's reward from the game (win 1, loss -1 or 0 in most games).
"""

from __future__ import annotations

from typing import Callable

from ..errors import ConfigError, EnvError
from .environment import Environment, Reply

PREFIX = "textarena:"


def _package():
    try:
        import textarena
    except ImportError:
        raise ConfigError("env.name: textarena: games need the textarena package; pip install textarena") from None
    return textarena


def _game_text(observation) -> str:
    """The game's own messages (not the player's echoed action) of a raw observation list, or a text one."""
    if isinstance(observation, str):
        return observation.strip()
    return "\n".join(str(msg) for sender, msg, *_ in observation if sender == -1).strip()


class TextArenaEnvironment(Environment):
    """One single-player game of `env_id` (its -raw variant: the messages of each turn, not the whole log)."""

    def __init__(self, env_id: str) -> None:
        self.env_id = env_id if env_id.endswith("-raw") else env_id + "-raw"
        self.game = None

    def _start(self, seed: int | None) -> str:
        self.game = _package().make(self.env_id)
        self.game.reset(num_players=1, seed=seed)
        return _game_text(self.game.get_observation()[1])

    def first_prompt(self, seed: int) -> list[dict]:
        return [{"role": "user", "content": self._start(seed)}]

    def reset(self, row: dict) -> None:
        first = self._start(row.get("seed"))
        said = row["prompt"][-1]["content"] if isinstance(row.get("prompt"), list) else None
        if "seed" in row and said is not None and first != said:
            raise EnvError(f"environment textarena:{self.env_id}: reset(seed={row['seed']}) gave another first "
                           f"observation than the row's prompt")

    def step(self, text: str) -> Reply:
        done, _ = self.game.step(text)
        if done:
            rewards, _ = self.game.close()
            return Reply([], float((rewards or {}).get(0, 0.0)), True)
        return Reply([{"role": "user", "content": _game_text(self.game.get_observation()[1])}], 0.0, False)


def factory(spec: str) -> Callable[[], Environment]:
    env_id = spec[len(PREFIX):]
    registry = _package().envs.registration.ENV_REGISTRY
    if env_id not in registry:
        raise ConfigError(f"env.name: textarena has no game {env_id!r}; e.g. GuessTheNumber-v0, Wordle-v0")
    return lambda: TextArenaEnvironment(env_id)
