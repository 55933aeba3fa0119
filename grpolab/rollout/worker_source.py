"""Rollouts sampled ahead by rollout worker processes (train.async_steps = k, train.rollout_workers).

The logical clock (rollout/worker_pool.py): at step s the trainer publishes the policy after step s-1,
requests every batch that version may sample (up to batch s+k), and takes batch s, which was sampled with
the policy after step s-k-1. With several trainer ranks, rank 0 talks to the workers for the whole batch
and every rank gets it and keeps its share; every rank keeps the same clock and data position.

A checkpoint keeps the batches in flight whole (`in_flight.pt`, plus their prompts, versions and epochs in
trainer_state.json), so a resume needs no older weights: it puts them back and the clock goes on.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from .. import distributed as dist
from ..config import Config
from ..errors import TrainingError
from ..models.checkpoint import load_plain
from ..monitor.console import Console, StepProgress
from .generation import Generation
from .prompt_feed import PromptFeed, rank_share
from .source import RolloutSource, Taken, check_clock, diverged
from .vllm_source import vllm_options
from .worker_pool import STOPPED, WorkerError, WorkerPool, weight_version

IN_FLIGHT = "in_flight.pt"


class WorkerSource(RolloutSource):
    saves_files = True

    def __init__(self, cfg: Config, model, feed: PromptFeed, world: dist.World, progress: StepProgress, *,
                 tools=None, console: Console | None = None, full_weights=None) -> None:
        self.model, self.feed, self.world, self.progress, self.cfg = model, feed, world, progress, cfg
        self.device, self.console = next(model.parameters()).device, console
        self.k, self.n_workers, self.max_steps = cfg.train.async_steps, cfg.train.worker_count, cfg.train.max_steps
        self.pool: WorkerPool | None = None      # started at the first take, after a resume put back the weights
        self.published = 0                       # the newest policy version the workers may sample with
        self.next_batch = 1                      # the next batch to request (batch t: the batch of step t)
        self.in_flight: dict[int, dict] = {}     # requested, not yet trained on: rows, version, epoch
        self.ready: dict[int, tuple] = {}        # arrived before they were needed (or from a checkpoint)
        if self.k and cfg.algorithm.rollout_correction == "none" and console is not None and world.main:
            console.warn(f"train.async_steps={self.k} with algorithm.rollout_correction=none: batches sampled "
                         f"by a policy up to {self.k} steps old are trained on as if on-policy; "
                         f"algorithm.rollout_correction=tis (or mis) corrects for it")

    def publish(self, model, version: int) -> None:
        self.published = version

    def take(self, step: int) -> Taken:
        """The batch of step `step` + 1, this rank's share."""
        self.progress.start_phase(f"waiting for batch {step + 1}")
        s, main = step + 1, self.world.main
        t0 = time.perf_counter()
        start_s = None
        if main and self.pool is None:
            self.pool = self._start()
            start_s = time.perf_counter() - t0
        t_sync = time.perf_counter()
        if main:
            self.pool.publish(self.published)   # from here on the newest version the workers hold
        sync_s = time.perf_counter() - t_sync
        self._request_up_to(min(s + self.k, self.max_steps), step)
        t1 = time.perf_counter()
        got = (self.ready.pop(s) if s in self.ready else self._take(s, step)) if main else None
        gens, times = dist.broadcast_object(got)
        wait_s = time.perf_counter() - t1
        meta = self.in_flight.pop(s)
        rows = meta["rows"]
        if self.world.size > 1:   # this rank's share: whole groups, in order (as the built-in source splits)
            share = rank_share(len(rows), self.world.rank, self.world.size)
            rows = rows[share]
            gens = [g.rows(share.start * r, share.stop * r) for g, r in zip(gens, self.feed.rows_per_prompt())]
        batch = self.feed.batch(rows, [g.to(self.device) for g in gens], meta["version"])
        metrics = {"time/rollout_wait": wait_s, "time/weight_sync": sync_s, **times}
        if start_s is not None:   # the first step of this process (inside its time/step)
            metrics["time/worker_start"] = start_s
        # how far behind the policy that sampled this batch was, in optimizer steps
        metrics.update({"async/weight_version": meta["version"], "async/staleness": step - meta["version"]})
        return Taken(batch, meta["epoch"], metrics)

    def _request_up_to(self, last: int, step: int) -> None:
        """Draw and request every batch up to `last` not yet requested."""
        while self.next_batch <= last:
            b = self.next_batch
            req = self.feed.draw()
            # (a finished run resumed with a larger train.max_steps never sampled the batches past its old
            # end: they get the policy it ended with, the oldest one still there)
            v = max(weight_version(b, self.k), step)
            if self.world.main:
                self.pool.request(b, v, self.feed.calls(req))
            self.in_flight[b] = {"rows": req.rows, "version": v, "epoch": req.epoch}
            self.next_batch += 1

    def _start(self) -> WorkerPool:
        """The rollout workers, given the model as it is now (and, with rollout.source=vllm, a vLLM engine to
        build on it). On GPUs each worker takes the next free GPU after the trainer ranks' own."""
        self.progress.start_phase("starting rollout workers")
        t, n = self.cfg.train, self.n_workers
        threads = t.worker_threads or t.threads or 1
        devices = ["cpu" if self.device.type == "cpu" else f"cuda:{self.world.local_size + i}" for i in range(n)]
        pool = WorkerPool(n, threads, devices, cuda_deterministic=t.cuda_deterministic,
                          stall_timeout=t.worker_stall_timeout)
        if self.console is not None and self.world.main:
            self.console.info(f"rollout workers: {n} process{'es' if n > 1 else ''} "
                              f"(pid {', '.join(str(p.pid) for p in pool.procs)}), {threads} torch thread"
                              f"{'s' if threads > 1 else ''} each, sampling {self.k} step"
                              f"{'s' if self.k != 1 else ''} ahead of the update (docs/async.md)")
        pool.ship(self.model, self.published, vllm_options(self.cfg) if self.cfg.rollout.source == "vllm" else None)
        return pool

    def _take(self, b: int, step: int) -> tuple:
        try:
            gens, times = self.pool.take(b, self.feed.tok.pad_id)
        except WorkerError as e:
            if e.reason == "nonfinite":
                raise diverged(step) from None
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
    def state(self) -> dict:
        """trainer_state.json's "async": the clock and the batches in flight (which it waits for first)."""
        for b in sorted(self.in_flight):
            if b not in self.ready:
                self.ready[b] = self._take(b, self.published + 1)   # (the trainer has done one more step)
        return {"async": {"async_steps": self.k, "next_batch": self.next_batch,
                          "in_flight": {str(b): m for b, m in self.in_flight.items()}}}

    def save(self, path: Path) -> None:
        """The batches in flight, whole (rank 0, after `state`)."""
        torch.save({str(b): {"gens": [g.tensors() for g in gens], "times": times}
                    for b, (gens, times) in self.ready.items()}, path / IN_FLIGHT)

    def restore(self, state: dict, ckpt: Path, step: int) -> None:
        """Put back the clock and the batches in flight of a checkpoint (none in one written without workers)."""
        saved = state.get("async") or {"async_steps": 0, "next_batch": step + 1, "in_flight": {}}
        check_clock(saved, self.k, ckpt)
        self.next_batch = saved["next_batch"]
        self.in_flight = {int(b): m for b, m in saved["in_flight"].items()}
        self.published = step
        if self.in_flight:
            batches = load_plain(ckpt / IN_FLIGHT)
            self.ready = {int(b): ([Generation(**t) for t in v["gens"]], v["times"]) for b, v in batches.items()}
