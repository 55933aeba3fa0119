"""A real OpenEnv environment server for tests/test_env_adapters.py: guess the seed's number from 1 to 9; the
action is the model's text ({"message": ...}), the number in it is the guess.

    python -m uvicorn openenv_guess:app --port PORT     (from tests/)
"""

import random
import re
import uuid

from openenv.core.env_server import Action, Environment, Observation, State, create_app


class TextAction(Action):
    message: str


class TextObservation(Observation):
    message: str = ""


class GuessEnv(Environment[TextAction, TextObservation, State]):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self):
        super().__init__()
        self._state, self._target = State(), 0

    def reset(self, seed=None, episode_id=None, **kw):
        self._target = random.Random(seed).randint(1, 9)
        self._state = State(episode_id=episode_id or uuid.uuid4().hex, step_count=0)
        return TextObservation(message=f"Game {seed}: guess my number from 1 to 9.", done=False, reward=None)

    def step(self, action, timeout_s=None, **kw):
        self._state.step_count += 1
        m = re.search(r"\d+", action.message)
        if m and int(m.group()) == self._target:
            return TextObservation(message="correct", done=True, reward=1.0)
        hint = "say a number" if m is None else ("higher" if int(m.group()) < self._target else "lower")
        return TextObservation(message=hint, done=self._state.step_count >= 6, reward=0.0)

    @property
    def state(self):
        return self._state


app = create_app(GuessEnv, TextAction, TextObservation, env_name="guess", max_concurrent_envs=64)
