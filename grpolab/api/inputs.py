"""What a Python caller hands a trainer, made into what `grpolab train` reads: reward specs, data files in the
run directory."""

from __future__ import annotations

import importlib
import json
import os
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


def write_rows(rows: list[dict], path: Path, what: str, resume: bool = False, write: bool = True) -> str:
    """`rows` as JSON lines at `path` (`write` False: only checked, the path returned). `resume`: the run's checkpoint
    continues the rows it was trained on, so a file already there must hold these rows (ConfigError naming `what`
    otherwise, the file left as it is)."""
    try:
        text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
    except TypeError as e:
        raise ConfigError(f"dataset rows must hold JSON values (text, numbers, lists, dicts): {e}") from None
    old = path.read_text() if path.is_file() else None
    if resume and old is not None and old != text:
        run = path.parent.parent
        raise ConfigError(f"{what}: other rows than the run in {run} was trained on ({path}); a resume continues on "
                          f"the run's rows: give the same rows, or start a new run in another output_dir "
                          f"(model.init_from=<one of its checkpoints> starts from its weights)")
    if write and old != text:   # a temporary file renamed over it: no reader sees a half-written file
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_text(text)
        os.replace(tmp, path)
    return str(path)
