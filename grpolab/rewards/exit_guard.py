"""os._exit inside a reward function, made visible: while reward functions run, os._exit (and posix._exit,
the same function) raises SystemExit in this process instead of ending it on the spot, and is recorded.

Unguarded, `os._exit(0)` in a reward ends `grpolab train` with exit 0, no message, no checkpoint and no
eval: a pipeline takes it for a finished run. Guarded, it is an exception, and combine.score turns the record
into one RewardError line (exit 2): also when the function catches the exception, so a swallowed
call still stops the run. Children the function forks (multiprocessing, the code_exec
sandbox) exit for real: the guard acts only in the process that installed it. What it cannot see:
code that ends the process below Python (ctypes' libc `_exit`, a C extension's `exit()`).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import posix
import threading
from collections.abc import Iterator

# the real one, for grpolab's own deliberate exits while a guard is installed (combine's watchdog)
REAL_EXIT = os._exit


_LOCK = threading.Lock()
_DEPTH = 0      # guards open (score() calls in progress, nested or from several threads)
_PID = 0        # the process that installed the guard
_CALLS: list[tuple[int, str | None]] = []   # (code, the asyncio task's name when called inside one), the run's


def _guarded_exit(code: int) -> None:
    if os.getpid() != _PID:   # a forked child of the function: its own exit, as it meant
        REAL_EXIT(code)
    _CALLS.append((code, _task_name()))
    # SystemExit: `except Exception` in the function does not catch it, and a thread of the function's that it
    # ends goes quietly (threading prints a traceback for any other exception); the record names the call
    raise SystemExit(code)


def _task_name() -> str | None:
    """The running asyncio task's name (combine names each async reward's task after it), or None."""
    try:
        task = asyncio.current_task()
    except RuntimeError:   # no event loop running in this thread
        return None
    return task.get_name() if task is not None else None


@contextlib.contextmanager
def guard() -> Iterator[None]:
    """os._exit raises SystemExit and is recorded (in this process, any thread) until the outermost guard ends."""
    global _DEPTH, _PID
    with _LOCK:
        if _DEPTH == 0:
            _PID = os.getpid()
            os._exit = posix._exit = _guarded_exit
        _DEPTH += 1
    try:
        yield
    finally:
        with _LOCK:
            _DEPTH -= 1
            if _DEPTH == 0:
                os._exit = posix._exit = REAL_EXIT


def calls_since(mark: int) -> list[tuple[int, str | None]]:
    """The os._exit calls recorded after `mark` (a `mark()`), oldest first."""
    return _CALLS[mark:]


def mark() -> int:
    return len(_CALLS)
