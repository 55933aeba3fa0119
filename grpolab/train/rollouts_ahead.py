"""The trainer's side of asynchronous RL (train.async_steps = k): the batches rollout workers sample ahead.

The logical clock (rollout/worker_pool.py): at step s the trainer publishes the policy after step s-1,
requests every batch that version may sample (up to batch s+k), and takes batch s, which was sampled with
the policy after step s-k-1. With several trainer ranks, rank 0 talks to the workers for the whole batch
and every rank gets it; every rank keeps the same clock and data position.

A checkpoint keeps the batches in flight whole (`in_flight.pt`, plus their prompts, versions and epochs in
trainer_state.json), so a resume needs no older weights: it puts them back and the clock goes on.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from .. import distributed as dist
from ..errors import ConfigError, TrainingError
from ..models.checkpoint import load_plain
from ..rollout.generation import Generation
from ..rollout.worker_pool import STOPPED, WorkerError, WorkerPool, weight_version

IN_FLIGHT = "in_flight.pt"


@dataclass
class Taken:
    """One step's batch as the workers sampled it."""
    rows: list[int]                 # the prompts' row indices (all ranks' prompts)
    gens: list[Generation]          # one per sampling call: the rollout, and ReMax's greedy completions
    version: int                    # the policy that sampled it: the one after this many steps
    epoch: float                    # the prompts' passes before this batch's prompts were drawn
    times: dict[str, float]         # time/rollout_wait, time/weight_sync, time/generate, time/worker_idle (and
    #                                 time/worker_start on a process's first step)


class RolloutsAhead:
    def __init__(self, k: int, workers: int, world: dist.World, pad_id: int) -> None:
        self.k, self.n_workers, self.world, self.pad_id = k, workers, world, pad_id
        self.pool: WorkerPool | None = None
        self.next_batch = 1                      # the next batch to request (batch t: the batch of step t)
        self.in_flight: dict[int, dict] = {}     # requested, not yet trained on: rows, version, epoch
        self.ready: dict[int, tuple] = {}        # arrived before they were needed (or from a checkpoint)
        self.start_s: float | None = None        # seconds to start the workers and ship the model

    def take(self, step: int, max_steps: int, start: Callable[[], WorkerPool],
             draw: Callable[[], tuple[list[int], torch.Tensor, float]],
             calls: Callable[[list[int], torch.Tensor], list[dict]], diverged: Callable[[], Exception]) -> Taken:
        """The batch of step `step` + 1. `start` starts the workers (given the policy as it is now); `draw`
        draws the next batch's prompts (row indices, draw numbers, epoch before them); `calls` makes their
        sampling calls; `diverged` is the error for a policy whose probabilities are NaN/inf."""
        s, main = step + 1, self.world.main
        t0 = time.perf_counter()
        if main and self.pool is None:
            self.pool = start()
            self.start_s = time.perf_counter() - t0
        t_sync = time.perf_counter()
        if main:
            self.pool.publish(step)   # the policy after step s-1: from here on the newest version the workers hold
        sync_s = time.perf_counter() - t_sync
        while self.next_batch <= min(s + self.k, max_steps):
            b = self.next_batch
            idx, draws, epoch = draw()
            # (a finished run resumed with a larger train.max_steps never sampled the batches past its old
            # end: they get the policy it ended with, the oldest one still there)
            v = max(weight_version(b, self.k), step)
            if main:
                self.pool.request(b, v, calls(idx, draws))
            self.in_flight[b] = {"rows": idx, "version": v, "epoch": epoch}
            self.next_batch += 1
        t1 = time.perf_counter()
        got = (self.ready.pop(s) if s in self.ready else self._take(s, diverged)) if main else None
        gens, times = dist.broadcast_object(got)
        meta = self.in_flight.pop(s)
        times = {"time/rollout_wait": time.perf_counter() - t1, "time/weight_sync": sync_s, **times}
        if self.start_s is not None:   # the first step of this process (inside its time/step)
            times["time/worker_start"], self.start_s = self.start_s, None
        return Taken(meta["rows"], gens, meta["version"], meta["epoch"], times)

    def _take(self, b: int, diverged: Callable[[], Exception]) -> tuple:
        try:
            gens, times = self.pool.take(b, self.pad_id)
        except WorkerError as e:
            if e.reason == "nonfinite":
                raise diverged() from None
            raise TrainingError(f"{e}; {STOPPED}") from None
        if times["version"] != self.in_flight[b]["version"]:   # the clock's promise, checked on what came back
            raise TrainingError(f"batch {b} came back sampled with weight version {times['version']}, not "
                                f"{self.in_flight[b]['version']}; the run stopped")
        return gens, {"time/generate": times["generate_s"], "time/worker_idle": times["idle_s"]}

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
            self.pool = None

    # ------------------------------------------------------------ checkpoints
    def state(self, diverged: Callable[[], Exception]) -> dict:
        """trainer_state.json's "async": the clock and the batches in flight (which it waits for first)."""
        for b in sorted(self.in_flight):
            if b not in self.ready:
                self.ready[b] = self._take(b, diverged)
        return {"async_steps": self.k, "next_batch": self.next_batch,
                "in_flight": {str(b): m for b, m in self.in_flight.items()}}

    def save(self, path: Path) -> None:
        """The batches in flight, whole (rank 0, after `state`)."""
        torch.save({str(b): {"gens": [g.tensors() for g in gens], "times": times}
                    for b, (gens, times) in self.ready.items()}, path / IN_FLIGHT)

    def restore(self, saved: dict | None, ckpt: Path, step: int) -> None:
        """Put back the clock and the batches in flight of a checkpoint (`saved`: its "async", None in a
        checkpoint written without workers)."""
        saved = saved or {"async_steps": 0, "next_batch": step + 1, "in_flight": {}}
        if saved["async_steps"] != self.k:   # the batches in flight were sampled on another clock
            raise ConfigError(f"train.async_steps: {ckpt} was written with train.async_steps={saved['async_steps']}; "
                              f"resume it with the same value (this run has {self.k})")
        self.next_batch = saved["next_batch"]
        self.in_flight = {int(b): m for b, m in saved["in_flight"].items()}
        if self.in_flight:
            batches = load_plain(ckpt / IN_FLIGHT)
            self.ready = {int(b): ([Generation(**t) for t in v["gens"]], v["times"]) for b, v in batches.items()}
