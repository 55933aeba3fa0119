"""Rows in a seeded order, one shuffled pass after another: GRPO's prompts and the offline stages'
rows are drawn from the same kind of stream. Its state is how far it has drawn; a restore puts it back
exactly there."""

from __future__ import annotations

import random


class RowStream:
    """Indices of `n` rows, drawn `k` at a time in shuffled passes (a draw may span two passes).

    Two shuffle schedules, kept as they were first released so runs and checkpoints stay bit-exact:
    `keyed` (GRPO's prompts): pass p is shuffled by Random(f"{seed}/{p}"), so a pass's order depends on
    its number alone and the state is {"epoch", "index"}; otherwise (the offline stages) one
    Random(seed) shuffles pass after pass, the state is {"drawn"} and a restore replays the shuffles."""

    def __init__(self, n: int, seed: int, *, keyed: bool = False) -> None:
        self.n, self.seed, self.keyed = n, seed, keyed
        self.restore({"epoch": 0, "index": 0} if keyed else {"drawn": 0})

    def _shuffled(self, epoch: int) -> list[int]:
        order = list(range(self.n))
        (random.Random(f"{self.seed}/{epoch}") if self.keyed else self._rng).shuffle(order)
        return order

    def next(self, k: int) -> list[int]:
        out: list[int] = []
        while len(out) < k:
            if self.index == len(self._order):   # the pass is used up (lazily: the next draw starts another)
                self.epoch, self.index = self.epoch + 1, 0
                self._order = self._shuffled(self.epoch)
            take = self._order[self.index:self.index + k - len(out)]
            out += take
            self.index += len(take)
        return out

    @property
    def drawn(self) -> int:
        """How many rows have been drawn so far: the draw number of the next one."""
        return self.epoch * self.n + self.index

    @property
    def passes(self) -> float:
        """Passes over the rows drawn so far (the offline stages' `epoch` metric)."""
        return self.drawn / max(1, self.n)

    def state(self) -> dict:
        return {"epoch": self.epoch, "index": self.index} if self.keyed else {"drawn": self.drawn}

    def restore(self, state: dict) -> None:
        if self.keyed:
            self.epoch, self.index = state["epoch"], state["index"]
            self._order = self._shuffled(self.epoch)
            return
        self._rng, self.epoch, self.index = random.Random(self.seed), 0, 0
        self._order = self._shuffled(0)
        self.next(state["drawn"])
