"""verl's reward convention, as a reward spec 'verl:<module or file.py>:<function>'.

verl calls `compute_score(data_source, solution_str, ground_truth, extra_info)` once per sample
(its naive reward manager), or, for a function with a `solution_strs` parameter,
`compute_score(data_sources, solution_strs, ground_truths, extra_infos)` once per batch (its batch
reward manager). Here, per sample:

    data_source   the row's `data_source` column (GSM8K rows: 'openai/gsm8k', see pipeline.load_data)
    solution_str  the completion text
    ground_truth  the row's reward_model['ground_truth'] (verl rows), else its reference (data.answer_key)
    extra_info    a copy of the row's `extra_info` dict, else {}

Arguments the function does not declare are left out, so verl's own scorers
(`verl.utils.reward_score.gsm8k:compute_score(solution_str, ground_truth, ...)`) run as they are.
A call at the end of the spec, 'verl:file.py:compute_score(format_score=0.1)', passes those
keywords on every call (verl's custom_reward_function.reward_kwargs). A returned dict gives its
'score' as the reward and its other keys as logged extras (see combine.score).
"""

from __future__ import annotations

import asyncio
import inspect
from typing import Callable

from ..errors import RewardError
from .calling import bind_keywords, completion_texts
from .custom import load_function, parse_call, resolved_key

PREFIX = "verl:"
SAMPLE_ARGS = ("data_source", "solution_str", "ground_truth", "extra_info")
BATCH_ARGS = ("data_sources", "solution_strs", "ground_truths", "extra_infos")

_MADE: dict[str, Callable] = {}


def _is_batch(fn) -> bool:
    try:
        return "solution_strs" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def _inputs(n: int, data_source, reward_model, answer, extra_info) -> list[list]:
    """Per-sample (data_sources, ground_truths, extra_infos) from the dataset columns."""
    sources = list(data_source) if data_source is not None else [None] * n
    rms = reward_model if reward_model is not None else [None] * n
    answers = answer if answer is not None else [None] * n
    truths = [rm["ground_truth"] if isinstance(rm, dict) and "ground_truth" in rm else a
              for rm, a in zip(rms, answers)]
    # a fresh dict per call, as verl builds one per sample, with the two keys verl's reward managers add
    # (single-turn rollouts: no turn count, no rollout-time scores)
    infos = [{**(x if isinstance(x, dict) else {}), "num_turns": None, "rollout_reward_scores": {}}
             for x in (extra_info if extra_info is not None else [None] * n)]
    return [sources, truths, infos]


def verl_reward(spec: str) -> Callable:
    """A TRL-convention reward function running the verl-style function named by `spec`
    ('verl:module:fn', 'verl:file.py:fn', optionally ending in a call with reward_kwargs)."""
    inner = spec[len(PREFIX):]
    base, args, reward_kwargs = parse_call(inner)
    if args:
        raise RewardError(f"reward {spec!r}: give verl reward_kwargs by keyword, e.g. "
                          f"'verl:{base}(format_score=0.1)'")
    key = resolved_key(base) + inner[len(base):]
    if key in _MADE:
        return _MADE[key]
    fn = load_function(base)
    batch = _is_batch(fn)
    names = BATCH_ARGS if batch else SAMPLE_ARGS
    # checked once here (no columns needed): a function that cannot take verl's arguments fails at load
    accepted = bind_keywords(fn, spec, {**dict.fromkeys(names), **reward_kwargs},
                             hint=f"; grpolab passes verl's {'batch' if batch else 'per-sample'} arguments")
    unknown = [k for k in reward_kwargs if k not in accepted]
    if unknown:   # verl would raise a TypeError: a misspelt keyword must not be dropped silently
        raise RewardError(f"reward {spec!r}: {getattr(fn, '__name__', 'the function')} takes no argument "
                          f"{unknown[0]!r}; check the spelling of the keywords in the spec")

    def call_args(values: list) -> dict:
        return bind_keywords(fn, spec, {**dict(zip(names, values)), **reward_kwargs})

    def samples(completions, data_source, reward_model, answer, extra_info):
        texts = completion_texts(completions)
        sources, truths, infos = _inputs(len(texts), data_source, reward_model, answer, extra_info)
        return list(zip(sources, texts, truths, infos))

    if inspect.iscoroutinefunction(fn):
        async def reward(completions, data_source=None, reward_model=None, answer=None, extra_info=None, **_):
            rows = samples(completions, data_source, reward_model, answer, extra_info)
            if batch:
                return list(await fn(**call_args([list(c) for c in zip(*rows)] if rows else [[]] * 4)))
            return list(await asyncio.gather(*(fn(**call_args(list(r))) for r in rows)))
    else:
        def reward(completions, data_source=None, reward_model=None, answer=None, extra_info=None, **_):
            rows = samples(completions, data_source, reward_model, answer, extra_info)
            if batch:
                return list(fn(**call_args([list(c) for c in zip(*rows)] if rows else [[]] * 4)))
            return [fn(**call_args(list(r))) for r in rows]

    reward.__name__ = getattr(fn, "__name__", "compute_score")
    reward.verl_function = fn
    _MADE[key] = reward
    return reward
