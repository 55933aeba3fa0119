"""Environments for tests/test_envs.py, loaded by spec ('tests/env_cases.py:Guess') as a user's would be."""

import math
import re
import time

from grpolab.envs.environment import Environment, Reply

SEEN: list = []   # (row answer, turn, text) of every step, for the tests that read what the environment saw


class Guess(Environment):
    """Guess the row's number: 'higher' / 'lower' until it is said; 1.0 for the right number, 0.1 for a turn that
    names any number."""

    def reset(self, row):
        self.target, self.turn = int(row["answer"]), 0

    def step(self, text):
        self.turn += 1
        SEEN.append((self.target, self.turn, text))
        m = re.search(r"\d+", text)
        if m and int(m.group()) == self.target:
            return Reply([], 1.0, True)
        hint = "say a number" if m is None else ("higher" if int(m.group()) < self.target else "lower")
        return Reply([{"role": "user", "content": hint}], 0.1 if m else 0.0, False)


class Again(Guess):
    """Never won: every turn is answered 'again'."""

    def step(self, text):
        return Reply([{"role": "user", "content": "again"}], 0.0, False)


class Raises(Guess):
    def step(self, text):
        raise ValueError("the board is on fire")


class Hangs(Guess):
    def step(self, text):
        time.sleep(600)


class NaNReward(Guess):
    def step(self, text):
        return Reply([{"role": "user", "content": "again"}], math.nan, False)


class LongReply(Guess):
    def step(self, text):
        return Reply([{"role": "user", "content": "blah " * 400}], 0.0, False)
