"""Score completions with several reward functions and combine them with weights."""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import math

import torch

from . import get_reward
from .errors import RewardError

__all__ = ["RewardError", "is_async", "score"]


def is_async(fn) -> bool:
    """True for `async def` functions (and callables whose __call__ is one)."""
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))


async def _gather(calls: list):
    # return_exceptions: one failing function must not cancel the others mid-flight
    return await asyncio.gather(*(fn(*args, **kwargs) for fn, args, kwargs in calls), return_exceptions=True)


def _run_async(calls: list) -> list:
    """Results (or exceptions) of the coroutine functions in `calls`, run concurrently in one event loop."""
    if not calls:
        return []
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(_gather(calls))
    # already inside an event loop (e.g. a notebook): asyncio.run would refuse, so use a fresh thread
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, _gather(calls)).result()


def _call(fn, prompts, completions, columns):
    """fn's values for one batch, sync or async."""
    if is_async(fn):
        out = _run_async([(fn, (prompts, completions), columns)])[0]
        if isinstance(out, BaseException):
            raise out
        return out
    return fn(prompts, completions, **columns)


def _failing_sample(fn, prompts, completions, columns) -> str:
    """' on sample i (completion ...)' for the first sample that fails alone, or '' when none does.

    Only runs after a batch call failed (training stops anyway), so re-calling per sample is affordable.
    """
    n = len(completions)
    for i in range(n):
        one = {k: v[i:i + 1] if isinstance(v, (list, tuple)) and len(v) == n else v for k, v in columns.items()}
        try:
            _call(fn, None if prompts is None else prompts[i:i + 1], completions[i:i + 1], one)
        except Exception:  # noqa: BLE001 - this is the sample to report
            text = completions[i] if len(completions[i]) <= 60 else completions[i][:57] + "..."
            return f" on sample {i} (completion {text!r})"
    return ""


def _column(name: str, values, n: int) -> torch.Tensor:
    """(n,) float tensor of `values` with None -> NaN; RewardError on a wrong count or a bad value."""
    if not isinstance(values, (list, tuple)) or len(values) != n:
        got = len(values) if isinstance(values, (list, tuple)) else type(values).__name__
        raise RewardError(f"reward function {name!r} returned {got} values for {n} completions; "
                          f"return one float (or None) per completion")
    col = torch.full((n,), float("nan"))
    for i, v in enumerate(values):
        if v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise RewardError(f"reward function {name!r} returned {v!r} for sample {i}; "
                              f"return a finite float or None")
        col[i] = float(v)
    return col


def score(names: list[str], weights: list[float] | None, prompts: list, completions: list[str],
          columns: dict[str, list]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(total (B,), {spec: (B,)}) for the reward specs `names`; total = sum_k w_k * r_k.

    A None from a function means "not applicable": it shows as NaN in that function's
    column and adds nothing to the total (TRL's convention). Async functions of one call
    run concurrently in one event loop; sync ones run one after another.
    """
    weights = [1.0] * len(names) if weights is None else list(weights)
    if len(weights) != len(names):
        raise RewardError(f"{len(weights)} reward weights for {len(names)} reward functions; give one per function")
    n = len(completions)
    fns = [get_reward(name) for name in names]

    async_idx = [k for k, fn in enumerate(fns) if is_async(fn)]
    async_out = dict(zip(async_idx, _run_async([(fns[k], (prompts, completions), columns) for k in async_idx])))

    total = torch.zeros(n, dtype=torch.float32)
    per_fn: dict[str, torch.Tensor] = {}
    for k, (name, w, fn) in enumerate(zip(names, weights, fns)):
        try:
            values = async_out[k] if k in async_out else fn(prompts, completions, **columns)
            if isinstance(values, BaseException):
                raise values
        except Exception as e:  # noqa: BLE001 - re-raised with the function's name and sample
            where = _failing_sample(fn, prompts, completions, columns)
            raise RewardError(f"reward function {name!r} raised {type(e).__name__}: {e}{where}") from e
        col = _column(name, values, n)
        per_fn[name] = col
        total += w * torch.nan_to_num(col, nan=0.0)
    return total, per_fn
