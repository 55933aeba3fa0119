"""Calling one reward function safely: sync or async, within a deadline, on its own copies of the inputs.

Sync functions run in the calling thread (the main thread: interrupted at the deadline by a watchdog's
signal) or in a daemon worker thread; async ones in one process-wide event loop run by a daemon thread.
Past the deadline a call raises Expired; what an async function raised comes back as a Raised value.
After a batch fails, `failing_sample` finds the first sample that fails alone, for the error line."""

from __future__ import annotations

import asyncio
import concurrent.futures
import copy
import inspect
import math
import signal
import sys
import threading
import time

from ..errors import RewardError
from ..utils.threads import call_all
from . import exit_guard
from .calling import RewardLog


def is_async(fn) -> bool:
    """True for `async def` functions (and callables whose __call__ is one)."""
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))


_ALARM = signal.SIGURG   # the main thread's wake-up past the deadline: its default action is to ignore it, so
#                          one that arrives after its handler is gone does nothing, and nothing in a trainer uses it
_SLICE = 0.2             # seconds between checks while the main thread waits for async functions (Ctrl-C stays prompt)


class Expired(BaseException):
    """A reward function ran past reward.timeout. A BaseException, so that the function's own
    `except Exception` cannot swallow it when it is raised inside the function (sync, main thread)."""


class Raised:
    """What an async reward function raised, carried out of the event loop as a value: SystemExit and
    KeyboardInterrupt raised inside a Task would stop the loop itself (and leave the caller waiting)."""

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


def _grace(timeout: float) -> float:
    """Seconds past the deadline before a function that ignores the interruption (stuck in C code that
    never returns to Python, or a blocked event loop) is given up on."""
    return min(10.0, max(2.0, timeout))


def late_error(name: str, limit: float, timeout: float) -> RewardError:
    """The one line for a function that ran past `limit` seconds (reward.timeout, or what code_exec's
    sandboxes may take)."""
    which = f"reward.timeout = {timeout:g} s" if limit == timeout else \
        f"{limit:g} s (reward.timeout = {timeout:g} s, raised to what its sandboxes may take)"
    return RewardError(f"reward function {name!r} did not return within {which} for one step's batch; make it "
                       f"return sooner (a timeout on its own network or subprocess calls), or raise reward.timeout "
                       f"(0 = no limit)")


_IN_CALL = threading.local()   # a reward function that calls score() itself: its inner calls run plainly


def run_sync(name: str, fn, kwargs: dict, timeout: float) -> object:
    """fn(**kwargs) for a sync function; Expired past `timeout` seconds (0 = no limit).

    In the main thread the function runs there, as TRL runs it: signal-based timeouts inside it (math-verify's,
    many verifiers') keep working and the results are the ones it gives without a limit. A watchdog thread
    interrupts it at the deadline. In any other thread it runs in a daemon worker thread, abandoned at the
    deadline (Python threads cannot be killed; a daemon one does not keep the process alive)."""
    if not timeout or getattr(_IN_CALL, "on", False):
        return fn(**kwargs)
    _IN_CALL.on = True
    try:
        if threading.current_thread() is threading.main_thread():
            return _in_main_thread(name, fn, kwargs, timeout)
        return _in_worker_thread(fn, kwargs, timeout)
    finally:
        _IN_CALL.on = False


def _in_main_thread(name: str, fn, kwargs: dict, timeout: float):
    late, live = threading.Event(), threading.Event()
    done = threading.Event()
    main = threading.main_thread().ident

    def on_alarm(_signum, _frame) -> None:
        if late.is_set() and live.is_set():
            raise Expired

    def watch() -> None:
        if done.wait(timeout):
            return
        late.set()
        give_up = time.monotonic() + _grace(timeout)
        while True:   # again every 0.2 s: the function may catch the first one (a bare `except:`)
            signal.pthread_kill(main, _ALARM)
            if done.wait(_SLICE):
                return
            if time.monotonic() > give_up:
                # it ignores the interruption (catches every one, or waits in C that never returns to Python):
                # the run cannot go on, and waiting helps no one
                print(f"grpolab: reward error: {late_error(name, timeout, timeout)} (interrupting it did not stop it; "
                      f"exiting)", file=sys.stderr, flush=True)
                exit_guard.REAL_EXIT(2)   # (os._exit is guarded while rewards run)

    try:
        old = signal.signal(_ALARM, on_alarm)
    except ValueError:   # not the main interpreter (a sub-interpreter has no signals): a worker thread instead
        return _in_worker_thread(fn, kwargs, timeout)
    live.set()
    watcher = threading.Thread(target=watch, name="grpolab-reward-timeout", daemon=True)
    try:
        watcher.start()
        out = fn(**kwargs)
        live.clear()    # from here a late wake-up is ignored
    finally:
        live.clear()
        done.set()
        watcher.join()
        signal.signal(_ALARM, old if old is not None else signal.SIG_DFL)
    if late.is_set():   # it returned only after the deadline (it caught the interruption)
        raise Expired
    return out


def _in_worker_thread(fn, kwargs: dict, timeout: float):
    ((ok, got),) = call_all([lambda: fn(**kwargs)], timeout, "grpolab-reward")
    if ok is None:
        raise Expired
    if not ok:
        raise got
    return got


async def _outcome(fn, kwargs: dict):
    try:
        return await fn(**kwargs)
    except asyncio.CancelledError:
        raise
    except BaseException as e:  # noqa: BLE001 - a value, see Raised
        return Raised(e)


async def _gather(calls: list, timeout: float) -> list:
    # every function in its own task, named after it; one failing must not cancel the others mid-flight
    loop = asyncio.get_running_loop()
    tasks = [loop.create_task(_outcome(fn, kwargs), name=name) for name, fn, kwargs in calls]
    try:
        await asyncio.wait(tasks, timeout=timeout or None)
    except asyncio.CancelledError:   # Ctrl-C in the caller
        for t in tasks:
            t.cancel()
        raise
    out = []
    for t in tasks:
        if t.done():
            out.append(t.result())
        else:
            t.cancel()
            out.append(Raised(Expired()))
    return out


_LOOP: asyncio.AbstractEventLoop | None = None
_LOOP_LOCK = threading.Lock()


def _event_loop() -> asyncio.AbstractEventLoop:
    """One event loop for the process, run by a daemon thread (as TRL does): an async reward that keeps
    a client, semaphore or lock bound to its loop works on every step, and a caller already inside an
    event loop (a notebook) is not in the way."""
    global _LOOP
    with _LOOP_LOCK:
        if _LOOP is None or _LOOP.is_closed():
            loop = asyncio.new_event_loop()
            threading.Thread(target=loop.run_forever, name="grpolab-async-rewards", daemon=True).start()
            _LOOP = loop
    return _LOOP


def run_async(calls: list, timeout: float) -> list:
    """Outcomes of the coroutine functions in `calls` ((name, fn, kwargs) each), run concurrently in one
    event loop: each function's values, or a Raised (an Expired one past `timeout`, 0 = no limit).

    The main thread waits in short slices, so Ctrl-C stops the wait (and cancels the functions). A
    function that blocks the loop itself (a sync call inside `async def`) raises Expired(name) here; the
    stuck loop is left to its daemon thread and the next call starts a new one."""
    global _LOOP
    if not calls:
        return []
    loop = _event_loop()
    fut = asyncio.run_coroutine_threadsafe(_gather(calls, timeout), loop)
    give_up = time.monotonic() + timeout + _grace(timeout) if timeout else math.inf
    try:
        while time.monotonic() < give_up:
            try:
                return fut.result(timeout=max(0.0, min(_SLICE, give_up - time.monotonic())))
            except concurrent.futures.TimeoutError:
                continue
    except BaseException:
        fut.cancel()
        raise
    fut.cancel()
    task = asyncio.current_task(loop)   # the one holding the loop
    with _LOOP_LOCK:
        if _LOOP is loop:
            _LOOP = None
    raise Expired(task.get_name() if task is not None else calls[0][0])


def _call(name: str, fn, kwargs: dict, timeout: float):
    """fn's values for one batch, sync or async, within `timeout` (Expired past it)."""
    if is_async(fn):
        out = run_async([(name, fn, kwargs)], timeout)[0]
        if isinstance(out, Raised):
            raise out.exc
        return out
    return run_sync(name, fn, kwargs, timeout)


def failing_sample(name: str, fn, kwargs: dict, texts: list[str], timeout: float) -> str:
    """' on sample i (completion ...)' for the first sample that fails alone, or '' when none does
    (or the probes together run past `timeout`).

    Only runs after a batch call failed (training stops anyway), so re-calling per sample is affordable.
    """
    n = len(texts)
    throwaway = RewardLog(1)
    end = time.monotonic() + timeout if timeout else math.inf
    for i in range(n):
        left = end - time.monotonic()
        if left <= 0:
            break
        one = {k: v[i:i + 1] if isinstance(v, (list, tuple)) and len(v) == n else v for k, v in kwargs.items()}
        if "log_extra" in one:
            one["log_extra"], one["log_metric"] = throwaway.bound("probe")
        try:
            _call(name, fn, own_copy(one), 0.0 if math.isinf(left) else left)
        except Expired:
            break
        except (Exception, SystemExit):  # noqa: BLE001 - this is the sample to report
            text = texts[i] if len(texts[i]) <= 60 else texts[i][:57] + "..."
            return f" on sample {i} (completion {text!r})"
    return ""


def exit_codes(name: str, was_async: bool, async_exits: list, mark: int) -> list[int]:
    """The codes of the os._exit calls `name` made: for an async function, those in its task (or in threads,
    which have no task), else those since `mark`."""
    if was_async:
        return [code for code, task in async_exits if task in (name, None)]
    return [code for code, _ in exit_guard.calls_since(mark)]


def exited_error(name: str, code, where: str = "") -> RewardError:
    return RewardError(f"reward function {name!r} called os._exit({code!r}){where}, which would end the run as if it "
                       f"had finished; return the values instead (raise an exception to stop the run)")


def raised_text(e: BaseException) -> str:
    """'ValueError: why' for an exception; SystemExit says it came from sys.exit()."""
    if isinstance(e, SystemExit):
        code = 0 if e.code is None else e.code   # sys.exit() exits 0, as the interpreter would
        return f"SystemExit ({code!r}: sys.exit() inside a reward function; return the values instead)"
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__


_ATOMS = frozenset((str, int, float, bool, type(None), bytes))


def _fresh(value):
    """A deep copy: plain data (lists, dicts and tuples of strings and numbers) copied directly, which is
    several times faster than copy.deepcopy; anything else through copy.deepcopy."""
    kind = type(value)
    if kind in _ATOMS:
        return value
    if kind is list:
        if _ATOMS.issuperset(map(type, value)):   # token ids, texts: a shallow copy is a deep one
            return value[:]
        return [_fresh(x) for x in value]
    if kind is dict:
        return {k: _fresh(v) for k, v in value.items()}
    if kind is tuple:
        return tuple(_fresh(x) for x in value)
    return copy.deepcopy(value)


# passed to every function as they are: its own loggers, the live policy (intrinsic rewards), the run's settings
_SHARED = ("log_extra", "log_metric", "policy", "runtime")


def own_copy(kwargs: dict) -> dict:
    """kwargs with fresh copies of the data: what one function edits in place, no other function sees."""
    return {k: v if k in _SHARED else _fresh(v) for k, v in kwargs.items()}


