"""Score completions with several reward functions and combine them with weights.

What a misbehaving function gets: one RewardError line naming it (and the first sample that fails
alone) when it raises anything (SystemExit included), calls os._exit (`exit_guard`), returns a value
that is not a float32-finite number or None, or runs past reward.timeout (the `runtime`'s). Each
function gets its own copies of its inputs (`harness`), so one that edits them in place changes
nothing for the others or the caller."""

from __future__ import annotations

import dataclasses
import inspect
import math
import numbers
import os

import torch

from ..errors import RewardError
from . import exit_guard, get_reward, reward_names
from .calling import CALL_ARGS, RewardLog, TrainerState, as_completions, bind_keywords, verl_hint
from .code import code_exec, tests_of
from .harness import (
    Expired,
    Raised,
    exit_codes,
    exited_error,
    failing_sample,
    is_async,
    late_error,
    own_copy,
    raised_text,
    run_async,
    run_sync,
)
from .runtime import RewardRuntime

# RewardLog and TrainerState (rewards/calling.py) re-exported: train/scoring.py and train/grpo.py import them here
__all__ = ["RewardLog", "TrainerState", "check_signatures", "check_tests", "number_mean", "score"]

# the largest float32: rewards, advantages and losses are float32 tensors
FLOAT32_MAX = float(torch.finfo(torch.float32).max)


def _limit(fn, n: int, runtime: RewardRuntime) -> float:
    """The seconds `fn` may take for n completions: reward.timeout, but for code_exec at least what its
    sandboxes may take (each program is killed at reward.code_exec.timeout; max_concurrent run at once),
    so that a batch of programs that all loop forever scores 0 instead of stopping the run."""
    timeout = runtime.timeout
    if not timeout or fn is not code_exec:
        return timeout
    t, workers = runtime.limits.timeout, runtime.max_concurrent or os.cpu_count() or 1
    return max(timeout, math.ceil(n / workers) * t + max(5.0, t) + 10.0)


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


def _takes_runtime(fn) -> bool:
    """Whether `fn` names a `runtime` parameter (a **kwargs function is not given one: what TRL's convention
    passes it stays as it was)."""
    try:
        p = inspect.signature(fn).parameters.get("runtime")
    except (TypeError, ValueError):
        return False
    return p is not None and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)


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
        if fn is code_exec:
            check_tests(f"reward function {name!r}", rows, column_names, source)
        for col in _needed_columns(fn, column_names):
            if all(row.get(col) is None for row in rows):
                where = f" of {source}" if source else ""
                fix = ("set data.answer_key to the column that holds the reference answers, or use a reward that "
                       "needs none" if col == "answer" else
                       "fill it in, or give the function's parameter a default if it can do without")
                raise RewardError(f"reward function {name!r} needs the dataset column {col!r}, but none of the "
                                  f"{len(rows)} rows{where} has a value for it; {fix}")


def check_tests(who: str, rows: list[dict], column_names: list[str], source: str = "") -> None:
    """RewardError unless some row has tests: `who` (code_exec as a reward function, or as the eval's check) would
    score every completion of these rows None (reward NaN, eval accuracy 0)."""
    if rows and all(tests_of(row) is None for row in rows):
        where = f" of {source}" if source else ""
        raise RewardError(f"{who} runs each row's tests, but no row{where} has any: give a 'test' column (code "
                          f"defining check(candidate), with 'entry_point') or a 'test_cases' column ([{{\"input\", "
                          f"\"output\"}}, ...]; verl: reward_model.ground_truth); columns found: "
                          f"{', '.join(map(str, column_names))}")


def score(names: list[str], weights: list[float] | None, prompts: list, completions: list[str],
          columns: dict[str, list], *, completion_ids: list[list[int]] | None = None,
          trainer_state: TrainerState | None = None, log: RewardLog | None = None,
          policy=None, timeout: float | None = None,
          runtime: RewardRuntime | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(total (B,), {spec: (B,)}) for the reward specs `names`; total = sum_k w_k * r_k.

    Each function is called by keyword as TRL does (`calling`): prompts, completions (strings,
    or assistant messages for conversational prompts), completion_ids, trainer_state, log_extra,
    log_metric and the dataset `columns`. A None from a function means "not applicable": it shows
    as NaN in that function's column and adds nothing to the total (TRL's convention). A dict
    value gives its 'score'; its other keys become `log.columns` '<name>/<key>' (listed in
    `log.score_keys`). Async functions of one call run concurrently in one event loop; sync ones run
    one after another, in the calling thread. `policy` (a rewards.intrinsic.PolicyView) is passed to
    the functions that take it: intrinsic rewards. `runtime` (the run's reward settings; None = the
    schema's defaults) is passed to the functions that name a `runtime` parameter: code_exec.

    Every function gets its own copies of the prompts, completions, completion ids and columns. Each
    may take `timeout` seconds (None: the runtime's reward.timeout; 0 = no limit); past it, or when it
    raises anything (SystemExit included) or returns a value that is not a float32-finite number or None,
    a RewardError names it (and the first sample that fails alone). Ctrl-C still stops the call.
    """
    runtime = runtime if runtime is not None else RewardRuntime()
    if timeout is not None:
        runtime = dataclasses.replace(runtime, timeout=float(timeout))
    timeout = runtime.timeout
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
        bound = bind_keywords(fn, name, kwargs, verl_hint(fn))   # (the caller's objects: copied per call)
        calls.append({**bound, "runtime": runtime} if _takes_runtime(fn) else bound)

    with exit_guard.guard():   # os._exit inside a function raises (and is recorded) instead of ending the process
        async_idx = [k for k, fn in enumerate(fns) if is_async(fn)]
        async_mark = exit_guard.mark()
        try:
            async_out = dict(zip(async_idx, run_async([(names[k], fns[k], own_copy(calls[k])) for k in async_idx],
                                                       timeout)))
        except Expired as e:
            raise late_error(e.args[0], timeout, timeout) from None
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
                limit = _limit(fn, n, runtime)
                values = async_out[k] if k in async_out else run_sync(name, fn, own_copy(calls[k]), limit)
                if isinstance(values, Raised):
                    raise values.exc
            except RewardError:
                raise
            except Expired:
                raise late_error(name, limit, timeout) from None
            except KeyboardInterrupt as e:   # Ctrl-C (a second one, in training) stops now, saying where
                if str(e):
                    raise
                raise KeyboardInterrupt(f"interrupted in reward function {name!r}") from None
            except (Exception, SystemExit) as e:  # noqa: BLE001 - re-raised with the function's name and sample
                exits = exit_codes(name, k in async_out, async_exits, mark)
                where = failing_sample(name, fn, calls[k], completions, timeout)
                if exits:
                    raise exited_error(name, exits[0], where) from None
                raise RewardError(f"reward function {name!r} raised {raised_text(e)}{where}") from e
            exits = exit_codes(name, k in async_out, async_exits, mark)
            if exits:   # it caught what os._exit raised: the run stops all the same
                raise exited_error(name, exits[0], " (in a thread of its own, or caught the SystemExit it raised)")
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
