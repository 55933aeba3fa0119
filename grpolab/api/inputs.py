"""What a Python caller hands a trainer, made into what `grpolab train` reads: reward specs, data files in the
run directory, a model directory, LoRA keys."""

from __future__ import annotations

import importlib
import json
import re
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from ..rewards import PASSED


def reward_specs(funcs: list) -> list[str]:
    """The specs `grpolab train` would name `funcs` by: a string as it is; a function importable by its module and
    name as 'module:name' (the run's config.yaml then runs from the command line too); any other callable (a
    lambda, a closure, a function of a notebook or script) as 'python:<name>', held for this process (the latest
    function of that name: a notebook cell run again replaces it, and the metric names stay the same)."""
    out: list[str] = []
    for fn in funcs:
        if isinstance(fn, str):
            out.append(fn)
            continue
        if not callable(fn):
            raise ConfigError(f"reward_funcs: {fn!r} is neither a function nor a reward spec string")
        module, name = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")
        if module and module != "__main__" and re.fullmatch(r"[A-Za-z_]\w*", name or ""):
            try:
                if getattr(importlib.import_module(module), name, None) is fn:
                    out.append(f"{module}:{name}")
                    continue
            except ImportError:
                pass
        base = re.sub(r"\W", "_", getattr(fn, "__name__", "") or "reward").strip("_") or "reward"
        spec, n = f"python:{base}", 1
        while spec in out:   # two functions of one name in one list
            n += 1
            spec = f"python:{base}_{n}"
        PASSED[spec] = fn
        out.append(spec)
    return out


def rows_of(data: Any, what: str) -> list[dict] | str:
    """A dataset as rows, or a path left for the loader: a `datasets.Dataset`, a list of dicts, or a path (str/Path)
    in any format `grpolab train` reads."""
    if isinstance(data, (str, Path)):
        return str(data)
    if hasattr(data, "to_list") and hasattr(data, "column_names"):   # datasets.Dataset
        return list(data.to_list())
    if isinstance(data, (list, tuple)) and all(isinstance(r, dict) for r in data):
        return [dict(r) for r in data]
    raise ConfigError(f"{what}: give a datasets.Dataset, a list of dicts or a path to a data file, not "
                      f"{type(data).__name__}")


def write_rows(rows: list[dict], path: Path) -> str:
    """`rows` as JSON lines at `path` (written again on every call with the same rows: a resume reads the same
    file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
    except TypeError as e:
        raise ConfigError(f"dataset rows must hold JSON values (text, numbers, lists, dicts): {e}") from None
    path.write_text(text)
    return str(path)


# peft LoraConfig fields grpolab maps, and the values of the others it accepts (peft's defaults)
LORA_DEFAULTS = {"bias": "none", "use_dora": False, "use_rslora": False, "modules_to_save": None,
                 "init_lora_weights": True, "layers_to_transform": None, "rank_pattern": {}, "alpha_pattern": {}}


def lora_settings(peft_config: Any) -> dict[str, Any]:
    """model.lora_* keys for a peft LoraConfig (None: no keys)."""
    if peft_config is None:
        return {}
    if not all(hasattr(peft_config, k) for k in ("r", "lora_alpha", "lora_dropout", "target_modules")):
        raise ConfigError(f"peft_config: a peft LoraConfig is expected, not {type(peft_config).__name__}")
    for k, default in LORA_DEFAULTS.items():
        value = getattr(peft_config, k, default)
        if value != default and not (default in (None, {}) and not value):
            raise ConfigError(f"peft_config.{k}={value!r}: not supported by grpolab (LoRA with {k}={default!r})")
    targets = peft_config.target_modules
    if targets is None:   # peft then picks layers per architecture, which grpolab does not copy
        raise ConfigError("peft_config.target_modules is None: name the layers (e.g. ['q_proj', 'v_proj']) or give "
                          "'all-linear'")
    if targets == "all-linear":
        targets = None   # grpolab's default: every linear layer of the blocks
    elif isinstance(targets, str):
        raise ConfigError(f"peft_config.target_modules={targets!r}: give a list of layer names or 'all-linear'")
    else:
        targets = sorted(targets)
    return {"model.lora_rank": int(peft_config.r), "model.lora_alpha": float(peft_config.lora_alpha),
            "model.lora_dropout": float(peft_config.lora_dropout), "model.lora_target_modules": targets}
