"""How a reward function is called: TRL's convention, by keyword.

For one batch of B completions grpolab calls every reward function as TRL's GRPOTrainer does:

    fn(prompts=[...B], completions=[...B], completion_ids=[...B], trainer_state=TrainerState(...),
       log_extra=callable, log_metric=callable, **columns)   # dataset columns by name, as TRL passes them
                                                             # (all but prompt, completion, completion_ids)

- `completions` are strings for plain-text prompts; for conversational prompts (message lists)
  each is one assistant message, `[{"role": "assistant", "content": text}]`, as TRL passes them.
- `completion_ids` are the sampled token ids of each completion, stop token included, no padding.
- A function with `**kwargs` receives everything; one without receives only the arguments it names
  (TRL would raise there). A required parameter grpolab does not pass is a one-line RewardError.
- A function that names a `runtime` parameter (with a default) also gets the run's settings
  (`runtime.RewardRuntime`: reward.code_exec's sandbox), e.g. to pass on to code_exec.
"""

from __future__ import annotations

import inspect
import math
from collections import defaultdict
from dataclasses import dataclass

from ..errors import RewardError

CALL_ARGS = ("prompts", "completions", "completion_ids", "trainer_state", "log_extra", "log_metric", "policy")


@dataclass
class TrainerState:
    """What reward functions get as `trainer_state`: the fields of transformers' TrainerState that
    reward shaping reads (e.g. a schedule over `global_step / max_steps`)."""
    global_step: int = 0           # optimizer steps done before this batch
    max_steps: int = 0
    epoch: float = 0.0             # passes over the train prompts so far (fractional)
    is_world_process_zero: bool = True
    is_local_process_zero: bool = True


class RewardLog:
    """What reward functions log during one batch: TRL's `log_metric(name, value)` scalars and
    `log_extra(column, values)` per-sample columns, plus the extra keys of dict returns.

    Columns are named '<reward name>/<column or key>', so two functions never overwrite each other."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.metrics: dict[str, list[float]] = defaultdict(list)   # name -> values logged this batch
        self.columns: dict[str, list] = {}                          # '<reward>/<column>' -> B values
        self.score_keys: list[str] = []   # the columns that came from dict returns' extra keys (logged as metrics)

    def bound(self, reward: str) -> tuple:
        """(log_extra, log_metric) for the reward function named `reward`."""
        def log_extra(column: str, values: list) -> None:
            values = list(values)
            if len(values) != self.n:
                raise RewardError(f"reward function {reward!r}: log_extra({column!r}) got {len(values)} values "
                                  f"for {self.n} completions; log one value per completion")
            self.columns[f"{reward}/{column}"] = values

        def log_metric(name: str, value: float) -> None:
            try:
                x = float(value)      # numbers, numpy scalars, one-element tensors
            except (TypeError, ValueError, RuntimeError):
                x = math.nan
            if not math.isfinite(x):
                raise RewardError(f"reward function {reward!r}: log_metric({name!r}) got {value!r}; "
                                  f"log a finite number")
            self.metrics[str(name)].append(x)
        return log_extra, log_metric

    def mean_metrics(self) -> dict[str, float]:
        return {k: sum(v) / len(v) for k, v in self.metrics.items() if v}


def is_conversational(prompts) -> bool:
    """TRL's test: the prompts are chat message lists (judged on the first, as TRL does)."""
    return bool(prompts) and isinstance(prompts[0], list)


def as_completions(prompts, texts: list[str]) -> list:
    """Completions as TRL passes them: one-message assistant turns for conversational prompts, else strings."""
    if is_conversational(prompts):
        return [[{"role": "assistant", "content": t}] for t in texts]
    return list(texts)


def completion_text(completion) -> str:
    """The text of a completion given either way: a string, or a list of messages (contents joined)."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, list):
        return "".join(str(m.get("content") or "") if isinstance(m, dict) else str(m) for m in completion)
    if isinstance(completion, dict):
        return str(completion.get("content") or "")
    raise TypeError(f"a completion is a string or a list of messages, got {type(completion).__name__}")


def completion_texts(completions) -> list[str]:
    return [completion_text(c) for c in completions]


def _signature(fn) -> inspect.Signature | None:
    try:
        return inspect.signature(fn)
    except (TypeError, ValueError):   # some builtins have none: call them with everything
        return None


def bind_keywords(fn, name: str, kwargs: dict, hint: str = "") -> dict:
    """The part of `kwargs` that `fn` accepts (all of it when fn takes **kwargs).

    RewardError (one line) when fn has a required parameter that is not in `kwargs`, or
    positional-only parameters: it then fits neither TRL's convention nor grpolab's.
    """
    sig = _signature(fn)
    if sig is None:
        return kwargs
    params = sig.parameters.values()
    if any(p.kind is p.VAR_KEYWORD for p in params):
        accepted = kwargs
    else:
        names = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
        accepted = {k: v for k, v in kwargs.items() if k in names}
    missing = [p.name for p in params
               if p.default is p.empty and (p.kind is p.POSITIONAL_ONLY or (
                   p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name not in accepted))]
    if missing:
        fixed = [k for k in kwargs if k in CALL_ARGS and k != "policy"]   # (policy: for intrinsic rewards only)
        if fixed:
            cols = [k for k in kwargs if k not in CALL_ARGS]
            passed = f"{', '.join(fixed)} and the dataset columns ({', '.join(cols) or 'none'}) (TRL's convention)"
        else:
            passed = ", ".join(kwargs)
        raise RewardError(f"reward function {name!r} needs {', '.join(map(repr, missing))}, which grpolab does not "
                          f"pass: it calls reward functions by keyword with {passed}; name the parameters after "
                          f"these and add **kwargs{hint}")
    return accepted


def verl_hint(fn) -> str:
    """A pointer to the verl: spec form for a function that looks like verl's compute_score."""
    sig = _signature(fn)
    if sig is not None and ({"solution_str", "solution_strs"} & set(sig.parameters)):
        return "; or, for a verl compute_score(data_source, solution_str, ground_truth, extra_info), " \
               "prefix the spec with 'verl:'"
    return ""
