"""reasoning-gym's procedural tasks as grpolab rows, scored by each task's own `score_answer`.

    data.task: reasoning_gym:<name>          e.g. reasoning_gym:basic_arithmetic
    data.task_config: {num_terms: 2, ...}    the dataset's config fields (its difficulty knobs)

A row: {"prompt": [system, user question], "answer": the entry's answer, "reasoning_gym": the entry}. The
system prompt is reasoning-gym's own default (think, then the answer inside <answer></answer>) unless
data.system_prompt is set. The `reasoning_gym` reward reads the last <answer>...</answer> of a completion (without
tags, for a numeric reference, its last number) and scores it with the row's dataset scorer (partial credit where
the task gives it). The package is an extra: `pip install 'grpolab[envs]'`.
"""

from __future__ import annotations

import dataclasses
import re
import typing

from ..config.names import REASONING_GYM_TASK as TASK_PREFIX
from ..data.answers import format_number, last_number, plain_number
from ..errors import ConfigError, DataError

# a test split drawn with this seed offset from train.seed, its questions seen in train dropped
TEST_SEED_OFFSET = 1_000_003
ANSWER = re.compile(r"<answer>\s?(.*?)\s?</answer>", re.DOTALL)


def _package():
    try:
        import reasoning_gym
    except ImportError:
        raise ConfigError("data.task: reasoning_gym tasks need the reasoning-gym package; "
                          "pip install 'grpolab[envs]'") from None
    return reasoning_gym


def task_name(task: str) -> str:
    """'reasoning_gym:<name>' -> '<name>'."""
    return task[len(TASK_PREFIX):]


def check_task(task: str, config: dict) -> None:
    """ConfigError in one line for an unknown dataset name or a config field it does not have."""
    rg = _package()
    name = task_name(task)
    known = rg.factory.DATASETS
    if name not in known:
        raise ConfigError(f"data.task: reasoning-gym has no dataset {name!r}; e.g. "
                          f"{', '.join(sorted(known)[:8])}, ... ({len(known)} in all)")
    declared = getattr(known[name][1], "__dataclass_fields__", {})
    fields = set(declared)
    unknown = sorted(set(config) - fields - {"size", "seed"})
    if unknown:
        raise ConfigError(f"data.task_config: {name} has no field {unknown[0]!r}; its fields: "
                          f"{', '.join(sorted(fields - {'size', 'seed'}))}")
    for key, value in config.items():   # its own checks compare values blindly ("'>' not supported between ...")
        wanted = _kind(declared[key])
        if wanted is not None and not _is(value, wanted):
            default = declared[key].default
            raise ConfigError(f"data.task_config.{key}: {name}'s {key} is {_KIND_WORDS[wanted[0]]}"
                              f"{' or null' if type(None) in wanted else ''}"
                              f"{'' if default is dataclasses.MISSING else f' (default {default!r})'}, got {value!r}")


_KIND_WORDS = {int: "a whole number", float: "a number", bool: "true or false", str: "a text"}


def _kind(field: dataclasses.Field) -> tuple[type, ...] | None:
    """The plain types a config field's annotation allows (int, float, bool or str, optionally None), or None for
    any other annotation (lists, enums: left to the dataset's own checks) or one its own default does not fit
    (rearc's diff_ub: int, default 0.2)."""
    kind, args = field.type, typing.get_args(field.type)
    if typing.get_origin(kind) is typing.Union and len(args) == 2 and type(None) in args:
        plain = [a for a in args if a is not type(None)][0]
        kinds = (plain, type(None)) if plain in _KIND_WORDS else None
    else:
        kinds = (kind,) if kind in _KIND_WORDS else None
    if kinds is None or (field.default is not dataclasses.MISSING and not _is(field.default, kinds)):
        return None
    return kinds


def _is(value: object, kinds: tuple[type, ...]) -> bool:
    """Whether `value` is one of `kinds` as YAML gives it: a bool is no number, an int is a float."""
    if isinstance(value, bool):
        return bool in kinds
    return (type(None) in kinds and value is None) or (int in kinds and isinstance(value, int)) \
        or (float in kinds and isinstance(value, (int, float))) or (str in kinds and isinstance(value, str))


def _entries(name: str, size: int, seed: int, config: dict) -> list[dict]:
    rg = _package()
    try:
        data = rg.create_dataset(name, size=size, seed=seed, **config)
        return [data[i] for i in range(size)]
    except (AssertionError, ValueError, TypeError) as e:   # its config checks
        said = str(e) or type(e).__name__
        named = any(key in said for key in config)   # else: the fields given, for the user to look at
        raise ConfigError(f"data.task_config: reasoning-gym's {name} refused its config: {said}"
                          f"{'' if named or not config else f' (given: {config})'}") from None


def load_rows(task: str, config: dict, train_size: int, test_size: int, seed: int,
              system_prompt: str | None) -> tuple[list[dict], list[dict]]:
    """(train rows, test rows): `train_size` entries drawn with `seed`, `test_size` with another seed whose
    questions also in train are dropped (held out, not memorised)."""
    check_task(task, config)
    name = task_name(task)
    system = system_prompt if system_prompt is not None else _package().utils.SYSTEM_PROMPTS["default"]
    train = _entries(name, train_size, seed, config)
    seen = {e["question"] for e in train}
    test = [e for e in _entries(name, test_size, seed + TEST_SEED_OFFSET, config) if e["question"] not in seen]
    if train_size and not train:
        raise DataError(f"data.task={task}: the dataset gave no rows")
    return [_row(e, system, name) for e in train], [_row(e, system, name) for e in test]


def _row(entry: dict, system: str, name: str) -> dict:
    prompt = [{"role": "user", "content": entry["question"]}]
    if system:
        prompt = [{"role": "system", "content": system}] + prompt
    return {"prompt": prompt, "answer": str(entry["answer"]), "reasoning_gym": {**entry, "dataset": name}}


def extract_answer(completion: str, reference: str | None = None) -> str | None:
    """The text inside the completion's last <answer>...</answer>, stripped. Without the tags, when the
    `reference` is a number, the completion's last number (as GSM8K rewards read one: a small model rarely
    writes the tags); else None."""
    found = ANSWER.findall(completion)
    if found:
        return found[-1].strip()
    if reference is None or plain_number(str(reference)) is None:
        return None
    value = last_number(completion)
    return None if value is None else format_number(value)


_SCORERS: dict[str, object] = {}


def scorer(name: str):
    """The dataset's score_answer(answer, entry) -> float in [0, 1] (made once per dataset)."""
    if name not in _SCORERS:
        _SCORERS[name] = _package().get_score_answer_fn(name)
    return _SCORERS[name]


def score(entry, completion: str) -> float | None:
    """The row's reasoning-gym scorer on the completion's last <answer>: 1.0 right, 0.0 wrong or no answer,
    partial credit where the task gives it; None for an entry that is not reasoning-gym's."""
    if not isinstance(entry, dict) or "dataset" not in entry:
        return None
    answer = extract_answer(completion, str(entry["answer"]))
    return 0.0 if answer is None else float(scorer(entry["dataset"])(answer, entry))
