"""The trainer's side of its rollout workers (train.async_steps, train.rollout_workers).

The logical clock: the batch that step t trains on is sampled with the policy after step
t - k - 1 (`weight_version`), k = train.async_steps. So while the trainer updates on batch t, the
workers already sample batches up to t + k, and which weights sampled which batch never depends on
timing: a run is the same run however fast either side is. The pool starts the worker processes,
sends the model once and each new weight version once (a broadcast), sends each batch's sampling
calls, and hands back each batch's completions, whole, in batch order.

A worker that dies, or a trainer that dies, ends the run: the other side's pending call fails at once
(closed sockets), and each side also watches the other's process. A worker that stops without dying
(SIGSTOP, Ctrl-Z, a frozen machine) stops beating: each worker counts a heartbeat on the trainer's store
every second, and a trainer waiting on a worker whose count has not moved for train.worker_stall_timeout
seconds ends the run naming it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import torch

from ..errors import TrainingError
from . import link
from .generation import Generation, cat_generations

STOPPED = "the run stopped (the last checkpoint is kept: train.resume=auto continues it)"
POLL_S = 0.2        # how often a waiting trainer looks at its workers' processes
REAP_S = 3.0        # how long a closed connection may take to show as the worker's exit status
JOIN_S = 30.0       # how long a thread left in a gloo call may take to fail once the workers are gone


def weight_version(batch: int, k: int) -> int:
    """The policy version that samples batch `batch` (1-based: the batch of step `batch`) when the
    rollouts run k steps ahead: the policy after step batch - k - 1; the initial one (version 0) for
    the first k + 1 batches. k = 0 is the synchronous loop: each batch with the policy just updated."""
    return max(0, batch - k - 1)


def _exit_reason(code: int) -> str:
    return f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"


class WorkerPool:
    """`n` rollout worker processes with `threads` torch threads each, on `devices` (CPU, or one GPU each).
    A worker prints tracebacks when GRPOLAB_DEBUG=1 (`grpolab --debug` sets it)."""

    def __init__(self, n: int, threads: int, devices: list[str], cuda_deterministic: bool = True,
                 stall_timeout: float = 0.0) -> None:
        self.n = n
        self.stall_timeout = stall_timeout   # 0: wait forever
        self.store = link.host_store(n + 1)
        # heartbeats read over a connection of their own: a client's calls take turns, and the groups' set-up
        # waits on the store for every worker (a stopped one: forever)
        self.beat_store = link.connect_store(self.store.port, n + 1)
        self.key = link.new_key()   # the workers get it from their environment, never from a socket
        now = time.monotonic()
        self.beats = {w: (0, now) for w in range(1, n + 1)}   # worker -> (its count, when it last moved)
        self._beats_read = now
        self._call: threading.Thread | None = None   # the last watched call (a stalled worker can leave it blocked)
        self.procs: list[subprocess.Popen] = []
        for w in range(1, n + 1):
            env = dict(os.environ, GRPOLAB_WORKERS=str(n), GRPOLAB_WORKER_RANK=str(w),
                       GRPOLAB_LINK_PORT=str(self.store.port), GRPOLAB_LINK_KEY=self.key.hex(),
                       GRPOLAB_WORKER_THREADS=str(threads),
                       GRPOLAB_WORKER_DEVICE=devices[w - 1], OMP_NUM_THREADS=str(threads),
                       GRPOLAB_CUDA_DETERMINISTIC="1" if cuda_deterministic else "0")
            # torchrun's variables would make a worker think it is a trainer rank
            for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
                env.pop(k, None)
            self.procs.append(subprocess.Popen([sys.executable, "-m", "grpolab.rollout.worker_process"], env=env))
        self.version = -1
        self.results: dict[tuple[int, int], dict] = {}   # (batch, worker) -> what it sent
        self.failure: str | None = None
        self.closing = False
        self.cond = threading.Condition()
        # the trainer's end: its own current GPU (the workers' GPUs are theirs), or the CPU
        self.receivers: list[threading.Thread] = []
        try:
            self.link = self._join("cuda" if devices[0].startswith("cuda") else "cpu")
        except BaseException:   # none of the workers may outlive a start that failed (a stopped one included)
            self.failure = self.failure or "starting"
            self.close()
            raise
        self.receivers = [threading.Thread(target=self._receive, args=(w,), daemon=True) for w in range(1, n + 1)]
        for t in self.receivers:
            t.start()

    def _join(self, device: str) -> link.Link:
        """Build the groups while watching the processes: a worker that fails to start is one line, now."""
        out = self._watched(link.Link.join, self.store, 0, self.n + 1, self.key, device, when="while starting")
        if isinstance(out, Exception):
            self._check_processes("while starting", wait=REAP_S)
            raise TrainingError(f"rollout workers could not connect: {out}".splitlines()[0])
        return out

    def _watched(self, fn, *args, when: str = ""):
        """fn(*args) (its value, or the exception it raised) in a thread of its own, while this one watches the
        workers: a gloo call blocks in C, where neither a dead or stalled worker nor Ctrl-C would be noticed.
        A stalled worker or a second Ctrl-C leaves the thread blocked; `close` kills the workers, which frees it."""
        box: list = []
        t = self._call = threading.Thread(target=lambda: box.append(self._try(fn, *args)), daemon=True)
        t.start()
        while t.is_alive():
            t.join(POLL_S)
            self._check_processes(when)
            self._check_stalls(when)
        return box[0]

    @staticmethod
    def _try(fn, *args):
        try:
            return fn(*args)
        except Exception as e:   # noqa: BLE001 - reported by the caller
            return e

    def _receive(self, w: int) -> None:
        """One thread per worker: its results into `self.results`, in the order it sends them."""
        while True:
            try:
                r = self.link.recv_result(w)
            except Exception:   # noqa: BLE001 - its sockets closed: the worker is gone
                r = None if self.closing else {"lost": True}
            with self.cond:
                if r is None:
                    return
                if r.get("lost"):
                    self.failure = self.failure or f"rollout worker {w}"
                    self.cond.notify_all()
                    return
                if "gens" in r:   # sent as tensors and plain containers (rollout/link.py)
                    r["gens"] = [None if g is None else Generation(**g) for g in r["gens"]]
                self.results[(r["batch"], w)] = r
                self.cond.notify_all()

    def _check_processes(self, when: str = "", wait: float = 0.0) -> None:
        """Raise the one line for a worker that has exited (waiting up to `wait` s for one to show)."""
        deadline = time.monotonic() + wait
        while True:
            for w, p in enumerate(self.procs, 1):
                if p.poll() is not None:
                    self.failure = self.failure or f"rollout worker {w}"
                    raise TrainingError(f"rollout worker {w} {_exit_reason(p.returncode)}{' ' + when if when else ''}"
                                        f"; {STOPPED}")
            if time.monotonic() >= deadline:
                return
            time.sleep(0.05)

    def _check_stalls(self, when: str = "") -> None:
        """Raise the one line for a worker whose heartbeat has not moved for stall_timeout seconds (read at
        most once per heartbeat period)."""
        now = time.monotonic()
        if not self.stall_timeout or now - self._beats_read < link.BEAT_S:
            return
        self._beats_read = now
        for w, p in enumerate(self.procs, 1):
            count = self.beat_store.add(link.beat_key(w), 0)
            seen, since = self.beats[w]
            if count != seen:
                self.beats[w] = (count, now)
            elif now - since > self.stall_timeout:
                self.failure = self.failure or f"rollout worker {w}"
                raise TrainingError(f"rollout worker {w} (pid {p.pid}) has shown no sign of life for "
                                    f"{now - since:.0f} s{' ' + when if when else ''} (stopped by SIGSTOP or Ctrl-Z, "
                                    f"or frozen; train.worker_stall_timeout = {self.stall_timeout:g} s); {STOPPED}")

    def _lost(self) -> None:
        self._check_processes(wait=REAP_S)
        raise TrainingError(f"{self.failure} stopped answering; {STOPPED}")

    def _send(self, fn, *args) -> None:
        """A broadcast to the workers; a dead one turns the gloo error into the one line, a stalled one is
        named after train.worker_stall_timeout."""
        out = self._watched(fn, *args)
        if isinstance(out, RuntimeError):
            self.failure = self.failure or "a rollout worker"
            self._lost()
        if isinstance(out, Exception):
            raise out

    # ------------------------------------------------------------ the trainer's calls
    def ship(self, model: torch.nn.Module, version: int, vllm: dict | None = None) -> None:
        """The model (architecture and every weight, as it is now: `version`) to every worker, once; `vllm`:
        VLLMEngine's options, for workers that sample with a vLLM engine built on the model's config."""
        self._send(self.link.send_command, link.MODEL, 0, version, {"model": model, "vllm": vllm})
        self.trained = [p for p in model.parameters() if p.requires_grad]
        self.version = version

    def publish(self, version: int) -> None:
        """The trained weights as they are now, as `version`, to every worker (once per version)."""
        if version == self.version:
            return
        self._send(self.link.send_command, link.WEIGHTS, 0, version)
        self._send(self.link.broadcast_weights, link.flat_weights(self.trained))
        self.version = version

    def request(self, batch: int, version: int, calls: list[dict]) -> None:
        """Batch `batch`: each sampling call (`rollout.engine.sample`'s arguments, the prompts under
        'prompts') split over the workers by prompt, sampled with weight `version` (already published)."""
        if version != self.version:
            raise ValueError(f"batch {batch} needs weight version {version}; version {self.version} is published")
        self._send(self.link.send_command, link.GENERATE, batch, version, calls)

    def take(self, batch: int, pad_id: int) -> tuple[list[Generation | None], dict]:
        """Batch `batch`, whole: one Generation per sampling call (the workers' shares joined in prompt
        order), and its timings: the slowest worker's generate_s and the idle_s before it started."""
        with self.cond:
            while not all((batch, w) in self.results for w in range(1, self.n + 1)) and not self.failure:
                self.cond.wait(POLL_S)
                if any(p.poll() is not None for p in self.procs):
                    break
                self._check_stalls()
            parts = [self.results.pop((batch, w), None) for w in range(1, self.n + 1)]
        if any(p is None for p in parts):
            self._lost()
        for w, p in enumerate(parts, 1):
            if "error" in p:
                raise WorkerError(w, p["error"])
        calls = len(parts[0]["gens"])
        gens = []
        for c in range(calls):
            shares = [p["gens"][c] for p in parts if p["gens"][c] is not None]
            gens.append(cat_generations(shares, pad_id) if shares else None)
        slowest = max(parts, key=lambda p: p["generate_s"])
        return gens, {"generate_s": slowest["generate_s"], "idle_s": min(p["idle_s"] for p in parts),
                      "version": parts[0]["version"]}

    def close(self) -> None:
        """Stop the workers (and wait for them); kill any that does not stop within seconds. After a
        failure the others are killed at once (they hold nothing a checkpoint needs)."""
        self.closing = True
        blocked = self._call is not None and self._call.is_alive()   # after a stall or a second Ctrl-C
        stop = None
        if self.failure is None and not blocked and all(p.poll() is None for p in self.procs):
            stop = threading.Thread(target=self._try, args=(self.link.send_command, link.STOP), daemon=True)
            stop.start()
            stop.join(REAP_S)   # a worker stopped since its last heartbeat would hold the broadcast forever
        if stop is None or stop.is_alive():
            for p in self.procs:
                if p.poll() is None:
                    p.kill()
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        # the threads blocked in gloo calls to the workers fail once their sockets close; a process that exits
        # while one is still inside gloo aborts ("terminate called without an active exception")
        for t in [*self.receivers, *(t for t in (self._call, stop) if t is not None)]:
            t.join(JOIN_S)


class WorkerError(RuntimeError):
    """A worker could not sample a batch; `reason` is 'nonfinite' or its one-line error."""

    def __init__(self, worker: int, reason: str) -> None:
        super().__init__(f"rollout worker {worker}: {reason}")
        self.worker, self.reason = worker, reason
