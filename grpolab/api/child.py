"""A Python-API job in a process of its own, for a caller that imported torch before grpolab.

The OpenMP runtime reads its settings (determinism.OPENMP_ENV) once, when torch loads it. A script that imports
peft, transformers or torch first starts it with the runtime's defaults, which ran the docs' example up to 5x slower
on a busy machine (docs/python-api.md#import-order). Such a caller's `train()` runs the job here instead: in a fresh
interpreter that imports grpolab before torch, with the run's config. What only the caller's process holds stays
there and is called from the job over a private socket pair (no listener): its reward functions
(`python:<name>`, `rewards.PASSED`) and its callbacks. The job is the one `grpolab <verb>` runs, so the bits are
the same as in-process.

    parent (Trainer.train)                      child (grpolab.api.child.main)
    start: job, keys, reward signatures   ->    runs the job
    reward call / callback event         <-     a reward's or a hook's call, waiting for its answer
    answer (value, exception or exit)    ->
    done / raised / interrupted          <-     the job's end: the parent returns or raises the same
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import importlib
import inspect
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
from multiprocessing.connection import Connection
from typing import Any, Callable

from .. import determinism
from ..config import Config
from ..distributed import world_from_env
from ..errors import ConfigError
from ..rewards import PASSED, exit_guard
from ..train.callbacks import Hooks
from ..train.run import adopt_lock, held_lock

# the child's interpreter: grpolab (and its OpenMP settings) before torch, as `python -m grpolab` does
CHILD_MAIN = "import sys; from grpolab.api.child import main; sys.exit(main(sys.argv))"
HOOK_EVENTS = ("begin", "step_end", "evaluated", "saved", "end")


def portable(e: BaseException) -> BaseException:
    """`e` if it survives pickling, else a RuntimeError with its text."""
    try:
        pickle.loads(pickle.dumps(e))
        return e
    except Exception:
        return RuntimeError(f"{type(e).__name__}: {e}")


def signature_of(fn: Callable) -> list[tuple[str, int, bool]]:
    """(name, kind, has a default) of each parameter: what the reward harness inspects to bind a call."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return [("args", inspect.Parameter.VAR_POSITIONAL, False), ("kwargs", inspect.Parameter.VAR_KEYWORD, False)]
    return [(p.name, int(p.kind), p.default is not inspect.Parameter.empty) for p in params]


# ---- the caller's side ------------------------------------------------------------------------------------------

def wanted(config: Config) -> bool:
    """Whether `train()` runs its job in a child: torch came before grpolab (determinism.OPENMP_MISSED) in a
    single-process run (a torchrun rank trains where it was started), and no reward of the caller's takes the
    policy (an intrinsic reward reads the model: it runs where the model is)."""
    if not determinism.OPENMP_MISSED or world_from_env().size > 1:
        return False
    return not any("policy" in inspect.signature(PASSED[s]).parameters
                   for s in config.reward.functions or [] if s in PASSED)


def run_in_child(job: Callable, config: Config, hooks: Hooks) -> dict:
    """Run `job(config, hooks=...)` in a child interpreter; the caller's `python:` rewards and `hooks` are called
    here. Returns the job's result, or raises what it raised (KeyboardInterrupt included)."""
    specs = [s for s in PASSED if s in (config.reward.functions or [])]
    ours, theirs = socket.socketpair()
    alive_r, alive_w = os.pipe()   # the child watches its end: EOF = this process is gone
    lock = held_lock(config.train.output_dir)   # the run's lock, taken by the trainer: the child holds it too
    fds = (theirs.fileno(), alive_r) + (() if lock is None else (lock,))
    cmd = [sys.executable, "-c", CHILD_MAIN, *map(str, fds)]
    # its own process group: a terminal's Ctrl-C reaches this process alone, which passes each one on once
    proc = subprocess.Popen(cmd, pass_fds=fds, start_new_session=True)
    theirs.close()
    os.close(alive_r)
    conn = Connection(ours.detach())
    try:
        conn.send(("start", f"{job.__module__}:{job.__name__}", config,
                   {s: signature_of(PASSED[s]) for s in specs}))
        with _forwarding_sigint(proc):
            return _serve(conn, proc, hooks)
    finally:
        conn.close()
        os.close(alive_w)
        if proc.poll() is None:
            proc.wait()


@contextlib.contextmanager
def _forwarding_sigint(proc: subprocess.Popen):
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, lambda *_: proc.poll() is None and proc.send_signal(signal.SIGINT))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _serve(conn: Connection, proc: subprocess.Popen, hooks: Hooks) -> dict:
    hook_error: list[BaseException] = []   # a callback's own exception, raised as itself at the end
    while True:
        if not _wait_readable(conn, proc):
            raise ConfigError(f"the training process ended without a result (exit code {proc.wait()}); run the "
                              f"script with grpolab imported before torch to train in this process")
        msg = conn.recv()
        kind = msg[0]
        if kind == "reward":
            _, call_id, spec, kwargs, loggers = msg
            logged: list[tuple[str, tuple]] = []
            for name in loggers:   # TRL's log_extra / log_metric: recorded here, replayed in the job
                kwargs[name] = functools.partial(lambda n, *a: logged.append((n, a)), name)
            how, value = _call_reward(PASSED[spec], kwargs, conn, proc)
            conn.send(("answer", call_id, how, (value, logged) if how == "value" else value))
        elif kind == "hook" and msg[1] in HOOK_EVENTS:
            _, event, args = msg
            try:
                getattr(hooks, event)(*args)
                conn.send(("answer", event, "value", (hooks.stop, hooks.state.max_steps)))
            except BaseException as e:   # noqa: BLE001 (a callback's exception goes to the job, as in-process)
                hook_error.append(e)
                conn.send(("answer", event, "raise", portable(e)))
        elif kind == "done":
            return msg[1]
        elif kind == "interrupted":
            raise KeyboardInterrupt(msg[1])
        elif kind == "raised":
            raise hook_error[-1] if hook_error and type(hook_error[-1]) is type(msg[1]) else msg[1]


def _wait_readable(conn: Connection, proc: subprocess.Popen) -> bool:
    """Whether a message waits (False: the child is gone without one)."""
    while not conn.poll(0.2):
        if proc.poll() is not None:
            return conn.poll(0)
    return True


def _call_reward(fn: Callable, kwargs: dict, conn: Connection, proc: subprocess.Popen) -> tuple[str, Any]:
    """("value", result) | ("raise", exception) | ("exit", code): the call made here, under the exit guard, in a
    thread of its own, so that a call that never returns still leaves the child's end of the run to be read (the
    child's harness times it out and ends the run)."""
    out: list[tuple[str, Any]] = []

    def call() -> None:
        mark = exit_guard.mark()
        try:
            with exit_guard.guard():
                value = fn(**kwargs)
                if inspect.isawaitable(value):
                    value = _await(value)
            codes = [code for code, _ in exit_guard.calls_since(mark)]
            out.append(("exit", codes[0]) if codes else ("value", value))
        except SystemExit as e:
            codes = [code for code, _ in exit_guard.calls_since(mark)]
            out.append(("exit", codes[0] if codes else e.code))
        except BaseException as e:   # noqa: BLE001 (the child's harness names the reward and the sample)
            out.append(("raise", portable(e)))

    t = threading.Thread(target=call, daemon=True, name="grpolab-reward")
    t.start()
    while t.is_alive():
        t.join(0.2)
        if t.is_alive() and (conn.poll(0) or proc.poll() is not None):
            return ("raise", TimeoutError("the reward call was abandoned"))
    return out[0]


def _await(awaitable: Any) -> Any:
    return asyncio.run(_as_coroutine(awaitable))


async def _as_coroutine(awaitable: Any) -> Any:
    return await awaitable


# ---- the child's side -------------------------------------------------------------------------------------------

class Link:
    """The child's end: one request at a time, each waiting for its answer."""

    def __init__(self, conn: Connection) -> None:
        self.conn, self.lock, self.calls = conn, threading.Lock(), 0

    def ask(self, message: tuple, tag: Any) -> Any:
        with self.lock:
            self.conn.send(message)
            while True:   # an answer to a call abandoned by a timeout may still come: skip it
                _, got, how, value = self.conn.recv()
                if got == tag:
                    break
        if how == "raise":
            raise value
        if how == "exit":
            os._exit(value)   # guarded while rewards run: the harness names the reward
        return value

    def remote_reward(self, spec: str, params: list[tuple[str, int, bool]]) -> Callable:
        def call(**kwargs: Any) -> Any:
            with self.lock:
                self.calls += 1
                tag = self.calls
            loggers = {k: v for k, v in kwargs.items() if callable(v)}
            plain = {k: v for k, v in kwargs.items() if k not in loggers}
            value, logged = self.ask(("reward", tag, spec, plain, list(loggers)), tag)
            for name, args in logged:
                loggers[name](*args)
            return value

        call.__signature__ = inspect.Signature([   # type: ignore[attr-defined]
            inspect.Parameter(n, inspect._ParameterKind(k), default=None if d else inspect.Parameter.empty)
            for n, k, d in params])
        call.__name__ = call.__qualname__ = spec.split(":", 1)[1]
        return call


class RemoteHooks(Hooks):
    """The caller's callbacks, called in the caller's process; `stop` and the state as they answer."""

    def __init__(self, link: Link) -> None:
        super().__init__()
        self.link = link

    def _forward(self, event: str, *args: Any) -> None:
        stop, self.state.max_steps = self.link.ask(("hook", event, args), event)
        self.control.should_training_stop = stop

    def begin(self, step: int, max_steps: int) -> None:
        self.state.global_step, self.state.max_steps = step, max_steps
        self._forward("begin", step, max_steps)

    def step_end(self, step: int, metrics: dict) -> None:
        self.state.global_step = step
        self._forward("step_end", step, metrics)

    def evaluated(self, step: int, metrics: dict) -> None:
        self._forward("evaluated", step, metrics)

    def saved(self) -> None:
        self._forward("saved")

    def end(self) -> None:
        self._forward("end")


def _watch_parent(fd: int) -> None:
    """The caller's process gone (its end of the pipe closed, e.g. killed): this one goes too, as the job would
    have gone with it in-process; the last checkpoint stays."""
    while os.read(fd, 1):
        pass
    os.kill(os.getpid(), signal.SIGKILL)


def main(argv: list[str]) -> int:
    conn = Connection(int(argv[1]))
    threading.Thread(target=_watch_parent, args=(int(argv[2]),), daemon=True).start()
    link = Link(conn)
    _, job_ref, config, signatures = conn.recv()
    if len(argv) > 3:
        adopt_lock(config.train.output_dir, int(argv[3]))
    module, name = job_ref.split(":")
    job = getattr(importlib.import_module(module), name)
    for spec, params in signatures.items():
        PASSED[spec] = link.remote_reward(spec, params)
    try:
        try:
            end = ("done", job(config, hooks=RemoteHooks(link)))
        except KeyboardInterrupt as e:
            end = ("interrupted", str(e))
        except BaseException as e:   # noqa: BLE001 (raised again in the caller's process)
            end = ("raised", portable(e))
        conn.send(end)
    except (EOFError, OSError):   # the caller is gone: nobody to tell
        return 1
    return 0

