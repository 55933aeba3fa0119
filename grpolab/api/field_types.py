"""The type each TRL config field takes, checked when the config is made (as TRL's dataclass would have it, before
any run): a field takes the type of its TRL default, unless the tables below say otherwise (a None default, or
more than one type). Plain data, no torch."""

from __future__ import annotations

import numbers
import os
from typing import Any

from ..config.validate import short
from ..errors import ConfigError

# what each kind accepts, in an error line's words
WORDS = {"int": "a whole number", "float": "a number", "bool": "True or False", "str": "a string",
         "path": "a path", "floats": "a list of numbers", "strs": "a list of strings", "none": "None"}

# fields of every config whose TRL default does not say their type
TRAINING_KINDS: dict[str, tuple[str, ...]] = {
    "output_dir": ("path", "none"),
    "warmup_steps": ("float",),        # transformers 5: below 1, a ratio of the steps
    # TRL's float steps (below 1, a ratio of the run) are whole steps to grpolab
    "logging_steps": ("int",),
    "save_steps": ("int",),
    "eval_steps": ("int", "none"),
    "save_total_limit": ("int", "none"),
    "report_to": ("str", "strs", "none"),
    "bf16": ("bool", "none"),
}
GRPO_KINDS: dict[str, tuple[str, ...]] = {
    **TRAINING_KINDS,
    "max_prompt_length": ("int", "none"),
    "top_k": ("int", "none"),
    "epsilon_high": ("float", "none"),
    "scale_rewards": ("str", "bool"),
    "reward_weights": ("floats", "none"),
    "vllm_max_model_length": ("int", "none"),
}
SFT_KINDS: dict[str, tuple[str, ...]] = {**TRAINING_KINDS, "max_length": ("int", "none"),
                                         "completion_only_loss": ("bool", "none"), "loss_type": ("str", "none")}
DPO_KINDS: dict[str, tuple[str, ...]] = {**TRAINING_KINDS, "loss_type": ("str", "strs")}
REWARD_KINDS: dict[str, tuple[str, ...]] = {**TRAINING_KINDS, "center_rewards_coefficient": ("float", "none")}


def kind_of(default: Any) -> tuple[str, ...]:
    """The kind a TRL default stands for (bool before int: a bool is an int to Python)."""
    for kind, t in (("bool", bool), ("int", int), ("float", float), ("str", str), ("floats", list)):
        if isinstance(default, t):
            return ("strs",) if t is list and default and isinstance(default[0], str) else (kind,)
    return ("none",)


def _is(kind: str, v: Any) -> bool:
    number = isinstance(v, numbers.Real) and not isinstance(v, bool)
    if kind == "int":   # a float with no fractional part is a whole number (max_steps=1e3)
        return isinstance(v, numbers.Integral) and not isinstance(v, bool) or number and float(v).is_integer()
    if kind in ("floats", "strs"):
        return isinstance(v, (list, tuple)) and all(_is("float" if kind == "floats" else "str", x) for x in v)
    return {"float": number, "bool": isinstance(v, bool), "str": isinstance(v, str), "none": v is None,
            "path": isinstance(v, (str, os.PathLike))}[kind]


def check_types(fields: dict[str, Any], owner: str, defaults: dict[str, Any],
                kinds: dict[str, tuple[str, ...]]) -> None:
    """ConfigError naming the first of `fields` (those in `defaults`, TRL's) whose value is not of its kind."""
    for name, value in fields.items():
        if name not in defaults:
            continue
        kind = kinds.get(name) or kind_of(defaults[name])
        if not any(_is(k, value) for k in kind):
            raise ConfigError(f"{owner}.{name}={short(value)}: expected {' or '.join(WORDS[k] for k in kind)}")
