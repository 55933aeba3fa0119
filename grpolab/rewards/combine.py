"""Score completions with several reward functions and combine them with weights."""

from __future__ import annotations

import asyncio
import copy
import inspect
import math
import numbers
import threading

import torch

from . import get_reward, reward_names
from .calling import CALL_ARGS, RewardLog, TrainerState, as_completions, bind_keywords, verl_hint
from .errors import RewardError

__all__ = ["RewardError", "RewardLog", "TrainerState", "check_signatures", "is_async", "number_mean", "score"]


def is_async(fn) -> bool:
    """True for `async def` functions (and callables whose __call__ is one)."""
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))


async def _gather(calls: list):
    # return_exceptions: one failing function must not cancel the others mid-flight
    return await asyncio.gather(*(fn(*args, **kwargs) for fn, args, kwargs in calls), return_exceptions=True)


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


def _run_async(calls: list) -> list:
    """Results (or exceptions) of the coroutine functions in `calls`, run concurrently in one event loop."""
    if not calls:
        return []
    return asyncio.run_coroutine_threadsafe(_gather(calls), _event_loop()).result()


def _call(fn, kwargs: dict):
    """fn's values for one batch, sync or async."""
    if is_async(fn):
        out = _run_async([(fn, (), kwargs)])[0]
        if isinstance(out, BaseException):
            raise out
        return out
    return fn(**kwargs)


def _failing_sample(fn, kwargs: dict, texts: list[str]) -> str:
    """' on sample i (completion ...)' for the first sample that fails alone, or '' when none does.

    Only runs after a batch call failed (training stops anyway), so re-calling per sample is affordable.
    """
    n = len(texts)
    throwaway = RewardLog(1)
    for i in range(n):
        one = {k: v[i:i + 1] if isinstance(v, (list, tuple)) and len(v) == n else v for k, v in kwargs.items()}
        if "log_extra" in one:
            one["log_extra"], one["log_metric"] = throwaway.bound("probe")
        try:
            _call(fn, one)
        except Exception:  # noqa: BLE001 - this is the sample to report
            text = texts[i] if len(texts[i]) <= 60 else texts[i][:57] + "..."
            return f" on sample {i} (completion {text!r})"
    return ""


def _number(v) -> float | None:
    """float(v) for a finite real number: bools, numpy scalars and one-element tensors included, as
    TRL's torch.tensor(values) takes them; None for anything else."""
    if not isinstance(v, numbers.Real) and hasattr(v, "item"):
        try:
            v = v.item()      # numpy scalar / 0-d array, torch 0-d tensor
        except (TypeError, ValueError, RuntimeError):
            return None
    if isinstance(v, numbers.Real) and math.isfinite(v):
        return float(v)
    return None


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


def check_signatures(names: list[str], column_names: list[str]) -> None:
    """Load every reward function and check that it can take grpolab's keyword arguments with
    these dataset columns: a misfit fails before the first rollout, with the same one line."""
    _check_columns(column_names)
    for name in names:
        fn = get_reward(name)
        bind_keywords(fn, name, dict.fromkeys([*CALL_ARGS, *(c for c in column_names if c not in NOT_PASSED)]),
                      verl_hint(fn))


def score(names: list[str], weights: list[float] | None, prompts: list, completions: list[str],
          columns: dict[str, list], *, completion_ids: list[list[int]] | None = None,
          trainer_state: TrainerState | None = None, log: RewardLog | None = None,
          policy=None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(total (B,), {spec: (B,)}) for the reward specs `names`; total = sum_k w_k * r_k.

    Each function is called by keyword as TRL does (`calling`): prompts, completions (strings,
    or assistant messages for conversational prompts), completion_ids, trainer_state, log_extra,
    log_metric and the dataset `columns`. A None from a function means "not applicable": it shows
    as NaN in that function's column and adds nothing to the total (TRL's convention). A dict
    value gives its 'score'; its other keys become `log.columns` '<name>/<key>' (listed in `log.score_keys`). Async functions of one call run
    concurrently in one event loop; sync ones run one after another. `policy` (a
    rewards.intrinsic.PolicyView) is passed to the functions that take it: intrinsic rewards.
    """
    weights = [1.0] * len(names) if weights is None else list(weights)
    if len(weights) != len(names):
        raise RewardError(f"{len(weights)} reward weights for {len(names)} reward functions; give one per function")
    n = len(completions)
    log = log if log is not None else RewardLog(n)
    short = reward_names(names)
    fns = [get_reward(name) for name in names]
    _check_columns(columns)
    # copies: a function that edits a prompt or a column in place must not edit the dataset's rows
    prompts, columns = copy.deepcopy(prompts), copy.deepcopy({k: v for k, v in columns.items()
                                                              if k not in NOT_PASSED})
    base = {"prompts": prompts, "completions": as_completions(prompts, completions),
            "completion_ids": completion_ids if completion_ids is not None else [[] for _ in range(n)],
            "trainer_state": trainer_state if trainer_state is not None else TrainerState(),
            **({"policy": policy} if policy is not None else {})}
    calls = []
    for name, fn in zip(names, fns):
        log_extra, log_metric = log.bound(short[name])
        kwargs = {**base, "log_extra": log_extra, "log_metric": log_metric, **columns}
        calls.append(bind_keywords(fn, name, kwargs, verl_hint(fn)))

    async_idx = [k for k, fn in enumerate(fns) if is_async(fn)]
    async_out = dict(zip(async_idx, _run_async([(fns[k], (), calls[k]) for k in async_idx])))

    total = torch.zeros(n, dtype=torch.float32)
    per_fn: dict[str, torch.Tensor] = {}
    for k, (name, w, fn) in enumerate(zip(names, weights, fns)):
        try:
            values = async_out[k] if k in async_out else fn(**calls[k])
            if isinstance(values, BaseException):
                raise values
        except RewardError:
            raise
        except Exception as e:  # noqa: BLE001 - re-raised with the function's name and sample
            where = _failing_sample(fn, calls[k], completions)
            raise RewardError(f"reward function {name!r} raised {type(e).__name__}: {e}{where}") from e
        col, extras = _column(name, values, n)
        per_fn[name] = col
        for key, vals in extras.items():
            log.columns[f"{short[name]}/{key}"] = vals
            log.score_keys.append(f"{short[name]}/{key}")
        total += w * torch.nan_to_num(col, nan=0.0)
    return total, per_fn
