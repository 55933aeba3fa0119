"""Score completions with several reward functions and combine them with weights.

What a misbehaving function gets: one RewardError line naming it (and the first sample that fails
alone) when it raises anything (SystemExit included), calls os._exit (`exit_guard`), returns a value
that is not a float32-finite number or None, or runs past reward.timeout (`configure`). Each function
gets its own copies of its inputs, so one that edits them in place changes nothing for the others or
the caller."""

from __future__ import annotations

import asyncio
import concurrent.futures
import copy
import inspect
import math
import numbers
import os
import signal
import sys
import threading
import time

import torch

from ..config import RewardConfig
from ..errors import RewardError
from . import exit_guard, get_reward, reward_names
from .calling import CALL_ARGS, RewardLog, TrainerState, as_completions, bind_keywords, verl_hint
from .code import SETTINGS as CODE_EXEC
from .code import code_exec, tests_of

__all__ = ["RewardError", "RewardLog", "TrainerState", "check_signatures", "configure", "is_async", "number_mean",
           "score"]

# the largest float32: rewards, advantages and losses are float32 tensors
FLOAT32_MAX = float(torch.finfo(torch.float32).max)

# reward.timeout for score() calls that do not pass their own: set by `configure`
_TIMEOUT: float = RewardConfig.timeout


def configure(reward: RewardConfig) -> None:
    """Take the run's reward section: reward.timeout for every later `score` call."""
    global _TIMEOUT
    _TIMEOUT = float(reward.timeout)


def is_async(fn) -> bool:
    """True for `async def` functions (and callables whose __call__ is one)."""
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))


# ---------------------------------------------------------------- running one function, within reward.timeout
_ALARM = signal.SIGURG   # the main thread's wake-up past the deadline: its default action is to ignore it, so
#                          one that arrives after its handler is gone does nothing, and nothing in a trainer uses it
_SLICE = 0.2             # seconds between checks while the main thread waits for async functions (Ctrl-C stays prompt)


class _Expired(BaseException):
    """A reward function ran past reward.timeout. A BaseException, so that the function's own
    `except Exception` cannot swallow it when it is raised inside the function (sync, main thread)."""


class _Raised:
    """What an async reward function raised, carried out of the event loop as a value: SystemExit and
    KeyboardInterrupt raised inside a Task would stop the loop itself (and leave the caller waiting)."""

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


def _grace(timeout: float) -> float:
    """Seconds past the deadline before a function that ignores the interruption (stuck in C code that
    never returns to Python, or a blocked event loop) is given up on."""
    return min(10.0, max(2.0, timeout))


def _limit(fn, n: int, timeout: float) -> float:
    """The seconds `fn` may take for n completions: reward.timeout, but for code_exec at least what its
    sandboxes may take (each program is killed at reward.code_exec.timeout; max_concurrent run at once),
    so that a batch of programs that all loop forever scores 0 instead of stopping the run."""
    if not timeout or fn is not code_exec:
        return timeout
    t, workers = CODE_EXEC.limits.timeout, CODE_EXEC.max_concurrent or os.cpu_count() or 1
    return max(timeout, math.ceil(n / workers) * t + max(5.0, t) + 10.0)


def _late(name: str, limit: float, timeout: float) -> RewardError:
    which = f"reward.timeout = {timeout:g} s" if limit == timeout else \
        f"{limit:g} s (reward.timeout = {timeout:g} s, raised to what its sandboxes may take)"
    return RewardError(f"reward function {name!r} did not return within {which} for one step's batch; make it "
                       f"return sooner (a timeout on its own network or subprocess calls), or raise reward.timeout "
                       f"(0 = no limit)")


_IN_CALL = threading.local()   # a reward function that calls score() itself: its inner calls run plainly


def _run_sync(name: str, fn, kwargs: dict, timeout: float):
    """fn(**kwargs) for a sync function; _Expired past `timeout` seconds (0 = no limit).

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
            raise _Expired

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
                print(f"grpolab: reward error: {_late(name, timeout, timeout)} (interrupting it did not stop it; "
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
        raise _Expired
    return out


def _in_worker_thread(fn, kwargs: dict, timeout: float):
    box: dict = {}
    done = threading.Event()

    def run() -> None:
        try:
            box["out"] = fn(**kwargs)
        except BaseException as e:  # noqa: BLE001 - handed to the caller's thread
            box["err"] = e
        finally:
            done.set()

    threading.Thread(target=run, name="grpolab-reward", daemon=True).start()
    if not done.wait(timeout):
        raise _Expired
    if "err" in box:
        raise box["err"]
    return box["out"]


async def _outcome(fn, kwargs: dict):
    try:
        return await fn(**kwargs)
    except asyncio.CancelledError:
        raise
    except BaseException as e:  # noqa: BLE001 - a value, see _Raised
        return _Raised(e)


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
            out.append(_Raised(_Expired()))
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


def _run_async(calls: list, timeout: float) -> list:
    """Outcomes of the coroutine functions in `calls` ((name, fn, kwargs) each), run concurrently in one
    event loop: each function's values, or a _Raised (an _Expired one past `timeout`, 0 = no limit).

    The main thread waits in short slices, so Ctrl-C stops the wait (and cancels the functions). A
    function that blocks the loop itself (a sync call inside `async def`) raises _Expired(name) here; the
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
    raise _Expired(task.get_name() if task is not None else calls[0][0])


def _call(name: str, fn, kwargs: dict, timeout: float):
    """fn's values for one batch, sync or async, within `timeout` (_Expired past it)."""
    if is_async(fn):
        out = _run_async([(name, fn, kwargs)], timeout)[0]
        if isinstance(out, _Raised):
            raise out.exc
        return out
    return _run_sync(name, fn, kwargs, timeout)


def _failing_sample(name: str, fn, kwargs: dict, texts: list[str], timeout: float) -> str:
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
            _call(name, fn, _own_copy(one), 0.0 if math.isinf(left) else left)
        except _Expired:
            break
        except (Exception, SystemExit):  # noqa: BLE001 - this is the sample to report
            text = texts[i] if len(texts[i]) <= 60 else texts[i][:57] + "..."
            return f" on sample {i} (completion {text!r})"
    return ""


def _exits(name: str, was_async: bool, async_exits: list, mark: int) -> list[int]:
    """The codes of the os._exit calls `name` made: for an async function, those in its task (or in threads,
    which have no task), else those since `mark`."""
    if was_async:
        return [code for code, task in async_exits if task in (name, None)]
    return [code for code, _ in exit_guard.calls_since(mark)]


def _exited(name: str, code, where: str = "") -> RewardError:
    return RewardError(f"reward function {name!r} called os._exit({code!r}){where}, which would end the run as if it "
                       f"had finished; return the values instead (raise an exception to stop the run)")


def _raised(e: BaseException) -> str:
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


def _number(v) -> float | None:
    """float(v) for a finite real number: bools, numpy scalars and one-element tensors included, as
    TRL's torch.tensor(values) takes them; None for anything else."""
    if not isinstance(v, numbers.Real) and hasattr(v, "item"):
        try:
            v = v.item()      # numpy scalar / 0-d array, torch 0-d tensor
        except (TypeError, ValueError, RuntimeError):
            return None
    if not isinstance(v, numbers.Real):
        return None
    try:
        x = float(v)
    except OverflowError:   # an int beyond every float (10**400): out of range, as 1e39 is
        return math.inf if v > 0 else -math.inf
    return x if math.isfinite(x) else None


def _column(name: str, values, n: int) -> tuple[torch.Tensor, dict[str, list]]:
    """((n,) float tensor of `values` with None -> NaN, {key: n values} of dict returns' other keys).

    A value is a number, None, or a dict with a 'score' number (verl's form; its other keys are
    extras, None where a sample lacks one). RewardError on a wrong count or a bad value.
    """
    if hasattr(values, "tolist") and not isinstance(values, (list, tuple)):
        values = values.tolist()    # a numpy array or a tensor, as TRL's torch.tensor(values) takes it
    if not isinstance(values, (list, tuple)) or len(values) != n:
        got = len(values) if isinstance(values, (list, tuple)) else type(values).__name__
        raise RewardError(f"reward function {name!r} returned {got} values for {n} completions; "
                          f"return one float (or None) per completion")
    col = torch.full((n,), float("nan"))
    extras: dict[str, list] = {}
    for i, v in enumerate(values):
        if isinstance(v, dict):
            if "score" not in v:
                raise RewardError(f"reward function {name!r} returned a dict without 'score' for sample {i} "
                                  f"(keys {sorted(v)}); put the reward under 'score'")
            for key, x in v.items():
                if key != "score":
                    extras.setdefault(str(key), [None] * n)[i] = x
            v = v["score"]
        if v is None:
            continue
        x = _number(v)
        if x is None:
            raise RewardError(f"reward function {name!r} returned {v!r} for sample {i}; "
                              f"return a finite float or None")
        if abs(x) > FLOAT32_MAX:   # rewards are float32 tensors: refused like inf, not clipped to a made-up value
            shown = repr(v) if len(repr(v)) <= 40 else f"{repr(v)[:20]}... ({len(repr(v))} characters)"
            raise RewardError(f"reward function {name!r} returned {shown} for sample {i}, beyond float32's range "
                              f"(|r| <= {FLOAT32_MAX:.4g}) that rewards are trained in; rescale the reward")
        col[i] = x
    return col, extras


def number_mean(values: list) -> float | None:
    """Mean over the values that are finite numbers; None when there are none."""
    nums = [x for x in map(_number, values) if x is not None]
    return sum(nums) / len(nums) if nums else None


# dataset columns TRL does not pass to reward functions (the completion is the sampled one)
NOT_PASSED = ("prompt", "completion", "completion_ids")


def _check_columns(column_names) -> None:
    clash = [c for c in column_names if c in CALL_ARGS and c not in NOT_PASSED]
    if clash:
        raise RewardError(f"dataset column {clash[0]!r} has the name of an argument grpolab passes to reward "
                          f"functions ({', '.join(CALL_ARGS)}); rename the column")


def _needed_columns(fn, column_names) -> list[str]:
    """The dataset columns `fn` cannot do without: its parameters without a default named after a column."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return []
    return [p.name for p in params if p.default is p.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
            and p.name in column_names and p.name not in CALL_ARGS]


def check_signatures(names: list[str], column_names: list[str], rows: list[dict] | None = None,
                     source: str = "") -> None:
    """Load every reward function and check that it can take grpolab's keyword arguments with
    these dataset columns: a misfit fails before the first rollout, with the same one line.

    With `rows` (the data, read from `source`): a function that needs a column (a parameter without a
    default, as gsm8k_accuracy's `answer`) that no row has a value for is refused too; it would
    otherwise score every completion 0 without a word. So is code_exec when no row has tests: it would
    score every completion None (reward NaN)."""
    _check_columns(column_names)
    for name in names:
        fn = get_reward(name)
        bind_keywords(fn, name, dict.fromkeys([*CALL_ARGS, *(c for c in column_names if c not in NOT_PASSED)]),
                      verl_hint(fn))
        if not rows:
            continue
        if fn is code_exec and all(tests_of(row) is None for row in rows):
            where = f" of {source}" if source else ""
            raise RewardError(f"reward function {name!r} runs each row's tests, but no row{where} has any: give a "
                              f"'test' column (code defining check(candidate), with 'entry_point') or a 'test_cases' "
                              f"column ([{{\"input\", \"output\"}}, ...]; verl: "
                              f"reward_model.ground_truth); columns found: {', '.join(map(str, column_names))}")
        for col in _needed_columns(fn, column_names):
            if all(row.get(col) is None for row in rows):
                where = f" of {source}" if source else ""
                fix = ("set data.answer_key to the column that holds the reference answers, or use a reward that "
                       "needs none" if col == "answer" else
                       "fill it in, or give the function's parameter a default if it can do without")
                raise RewardError(f"reward function {name!r} needs the dataset column {col!r}, but none of the "
                                  f"{len(rows)} rows{where} has a value for it; {fix}")


# passed to every function as they are: its own loggers, and the live policy (intrinsic rewards)
_SHARED = ("log_extra", "log_metric", "policy")


def _own_copy(kwargs: dict) -> dict:
    """kwargs with fresh copies of the data: what one function edits in place, no other function sees."""
    return {k: v if k in _SHARED else _fresh(v) for k, v in kwargs.items()}


def score(names: list[str], weights: list[float] | None, prompts: list, completions: list[str],
          columns: dict[str, list], *, completion_ids: list[list[int]] | None = None,
          trainer_state: TrainerState | None = None, log: RewardLog | None = None,
          policy=None, timeout: float | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(total (B,), {spec: (B,)}) for the reward specs `names`; total = sum_k w_k * r_k.

    Each function is called by keyword as TRL does (`calling`): prompts, completions (strings,
    or assistant messages for conversational prompts), completion_ids, trainer_state, log_extra,
    log_metric and the dataset `columns`. A None from a function means "not applicable": it shows
    as NaN in that function's column and adds nothing to the total (TRL's convention). A dict
    value gives its 'score'; its other keys become `log.columns` '<name>/<key>' (listed in
    `log.score_keys`). Async functions of one call run concurrently in one event loop; sync ones run
    one after another, in the calling thread. `policy` (a rewards.intrinsic.PolicyView) is passed to
    the functions that take it: intrinsic rewards.

    Every function gets its own copies of the prompts, completions, completion ids and columns. Each
    may take `timeout` seconds (None: reward.timeout as `configure`d; 0 = no limit); past it, or when it
    raises anything (SystemExit included) or returns a value that is not a float32-finite number or None,
    a RewardError names it (and the first sample that fails alone). Ctrl-C still stops the call.
    """
    timeout = _TIMEOUT if timeout is None else float(timeout)
    weights = [1.0] * len(names) if weights is None else list(weights)
    if len(weights) != len(names):
        raise RewardError(f"{len(weights)} reward weights for {len(names)} reward functions; give one per function")
    n = len(completions)
    log = log if log is not None else RewardLog(n)
    short = reward_names(names)
    fns = [get_reward(name) for name in names]
    _check_columns(columns)
    columns = {k: v for k, v in columns.items() if k not in NOT_PASSED}
    base = {"prompts": prompts, "completions": as_completions(prompts, completions),
            "completion_ids": completion_ids if completion_ids is not None else [[] for _ in range(n)],
            "trainer_state": trainer_state if trainer_state is not None else TrainerState(),
            **({"policy": policy} if policy is not None else {})}
    calls = []
    for name, fn in zip(names, fns):
        log_extra, log_metric = log.bound(short[name])
        kwargs = {**base, "log_extra": log_extra, "log_metric": log_metric, **columns}
        calls.append(bind_keywords(fn, name, kwargs, verl_hint(fn)))   # (the caller's objects: copied per call)

    with exit_guard.guard():   # os._exit inside a function raises (and is recorded) instead of ending the process
        async_idx = [k for k, fn in enumerate(fns) if is_async(fn)]
        async_mark = exit_guard.mark()
        try:
            async_out = dict(zip(async_idx, _run_async([(names[k], fns[k], _own_copy(calls[k])) for k in async_idx],
                                                       timeout)))
        except _Expired as e:
            raise _late(e.args[0], timeout, timeout) from None
        except KeyboardInterrupt as e:
            if str(e):
                raise
            raise KeyboardInterrupt("interrupted while the async reward functions ran") from None
        # os._exit calls in the event loop, by task (named after its function), or from threads they started
        async_exits = exit_guard.calls_since(async_mark)

        total = torch.zeros(n, dtype=torch.float32)
        per_fn: dict[str, torch.Tensor] = {}
        for k, (name, w, fn) in enumerate(zip(names, weights, fns)):
            mark = exit_guard.mark()
            try:
                limit = _limit(fn, n, timeout)
                values = async_out[k] if k in async_out else _run_sync(name, fn, _own_copy(calls[k]), limit)
                if isinstance(values, _Raised):
                    raise values.exc
            except RewardError:
                raise
            except _Expired:
                raise _late(name, limit, timeout) from None
            except KeyboardInterrupt as e:   # Ctrl-C (a second one, in training) stops now, saying where
                if str(e):
                    raise
                raise KeyboardInterrupt(f"interrupted in reward function {name!r}") from None
            except (Exception, SystemExit) as e:  # noqa: BLE001 - re-raised with the function's name and sample
                exits = _exits(name, k in async_out, async_exits, mark)
                where = _failing_sample(name, fn, calls[k], completions, timeout)
                if exits:
                    raise _exited(name, exits[0], where) from None
                raise RewardError(f"reward function {name!r} raised {_raised(e)}{where}") from e
            exits = _exits(name, k in async_out, async_exits, mark)
            if exits:   # it caught what os._exit raised: the run stops all the same
                raise _exited(name, exits[0], " (in a thread of its own, or caught the SystemExit it raised)")
            col, extras = _column(name, values, n)
            per_fn[name] = col
            for key, vals in extras.items():
                log.columns[f"{short[name]}/{key}"] = vals
                log.score_keys.append(f"{short[name]}/{key}")
            total += w * torch.nan_to_num(col, nan=0.0)
    bad = (~torch.isfinite(total)).nonzero()
    if len(bad):   # each value fits float32, but the weighted sum does not
        i = int(bad[0])
        raise RewardError(f"the weighted sum of the rewards overflows float32 on sample {i} (values "
                          f"{[float(per_fn[s][i]) for s in names]}, weights {weights}); rescale the rewards or weights")
    return total, per_fn
