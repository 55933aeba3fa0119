"""User reward functions from a spec: 'package.module:function' or 'path/to/file.py:function'.

A spec may end in a call with literal arguments, 'module:factory(max_len=64, scale=0.5)': the
factory is called once and the function it returns is the reward (as `reward_funcs=[factory(...)]`
in TRL). `parse_call` (config/reward_spec.py) splits such a spec; `verl_style` uses the arguments as
verl's reward_kwargs.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import importlib.util
import sys
from pathlib import Path
from typing import Callable

from ..config.reward_spec import parse_call
from ..errors import RewardError

_FORMS = "use 'package.module:function' or 'path/to/file.py:function'"


def _one_line(e: Exception) -> str:
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0]}" if lines else type(e).__name__


def split_spec(spec: str) -> tuple[str, str]:
    """('package.module' or 'path/to/file.py', 'function') from a custom spec; RewardError when malformed."""
    target, sep, attr = spec.rpartition(":")
    if not sep or not target or not attr:
        raise RewardError(f"reward {spec!r}: not a custom function spec; {_FORMS}")
    return target, attr


def is_file_target(target: str) -> bool:
    """A file path rather than a dotted module name (ends in .py or contains a path separator)."""
    return target.endswith(".py") or "/" in target or "\\" in target


def resolved_key(spec: str) -> str:
    """`spec` with a relative file path made absolute: the same file named from two directories is
    one key, and two files of the same name in different directories are two."""
    target, attr = split_spec(spec)
    return f"{Path(target).expanduser().resolve()}:{attr}" if is_file_target(target) else spec


# factory results by (resolved spec, call): one instance per run, so a stateful reward keeps its state
_MADE: dict[tuple, Callable] = {}


def load_reward(spec: str) -> Callable:
    """The reward function of a TRL-convention spec: the named callable, or what the named factory
    returns when the spec ends in a call (made once per process and spec)."""
    base, args, kwargs = parse_call(spec)
    fn = load_function(base)
    if base == spec:
        return fn
    key = (resolved_key(base), spec[len(base):])
    if key in _MADE:
        return _MADE[key]
    name = base.rpartition(":")[2]
    try:
        out = fn(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 - one readable line
        raise RewardError(f"reward {spec!r}: calling {name}(...) raised {_one_line(e)}; check its arguments") from e
    if not callable(out):
        raise RewardError(f"reward {spec!r}: {name}(...) returned a {type(out).__name__}, not a function; a call "
                          f"in a spec must return the reward function (a factory such as TRL's get_*_reward)")
    _MADE[key] = out
    return out


def load_function(spec: str) -> Callable:
    """The callable named by `spec` ('module:fn' or 'file.py:fn', no call); relative file paths
    resolve against the current directory.

    Raises RewardError with a one-line message naming the spec and the fix.
    """
    target, attr = split_spec(spec)
    if is_file_target(target):
        path = Path(target).expanduser().resolve()
        if not path.is_file():
            raise RewardError(f"reward {spec!r}: file {target!r} not found (looked at {path}); "
                              f"give a path relative to the current directory ({Path.cwd()}) or an absolute one")
        return _from_file(str(path), attr, spec)
    return _from_module(target, attr, spec)


def _from_module(name: str, attr: str, spec: str) -> Callable:
    try:
        module = importlib.import_module(name)
    except Exception as e:  # noqa: BLE001 - any import failure becomes one readable line
        raise RewardError(f"reward {spec!r}: cannot import module {name!r} ({_one_line(e)}); "
                          f"make sure it is installed or on PYTHONPATH, or use 'path/to/file.py:{attr}'") from e
    return _get_callable(module, attr, spec, f"module {name!r}")


# keyed by absolute path so one file is executed once per process, whatever cwd was used to name it
@functools.lru_cache(maxsize=None)
def _load_file_module(path: str):
    # unique, stable module name: two reward files both called rewards.py must not collide
    name = f"grpolab_user_reward_{Path(path).stem}_{hashlib.sha1(path.encode()).hexdigest()[:8]}"
    module_spec = importlib.util.spec_from_file_location(name, path)
    if module_spec is None or module_spec.loader is None:
        raise ImportError("not loadable as a Python module")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module  # so pickling/dataclasses inside the file resolve their module
    try:
        module_spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def _from_file(path: str, attr: str, spec: str) -> Callable:
    try:
        module = _load_file_module(path)
    except Exception as e:  # noqa: BLE001 - not cached by lru_cache, so a fixed file loads next time
        raise RewardError(f"reward {spec!r}: importing {path} raised {_one_line(e)}; "
                          f"fix the error in that file") from e
    return _get_callable(module, attr, spec, path)


def _get_callable(module, attr: str, spec: str, where: str) -> Callable:
    if not hasattr(module, attr):
        found = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_")
                       and getattr(v, "__module__", None) == module.__name__)
        hint = f"functions defined there: {', '.join(found)}" if found else "it defines no public functions"
        raise RewardError(f"reward {spec!r}: {where} has no attribute {attr!r}; {hint}")
    fn = getattr(module, attr)
    if not callable(fn):
        raise RewardError(f"reward {spec!r}: {attr!r} is not callable (it is a {type(fn).__name__} object); "
                          f"point the spec at a function fn(prompts, completions, **columns) -> list[float | None]")
    return fn
