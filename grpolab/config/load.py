"""Loading a configuration: defaults <- YAML file <- dotted CLI overrides (`rollout.temperature=0.8`),
each value checked against its declared type on the way in, then validate.validate(). Unknown keys
name the closest known one; every problem is one ConfigError line naming the key and the fix.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import re
import sys
from pathlib import Path
from typing import Any

import yaml

from ..errors import ConfigError
from .presets import PRESETS
from .schema import Config, JudgeConfig
from .validate import eval_check, need, short, validate

# keys that were renamed, old -> new: a config that sets the old key (a file, an override, the Python API's keys, a
# saved run's config.yaml) is read as setting the new one, so existing configs and run directories keep working
RENAMED: dict[str, str] = {
    "rollout.engine": "rollout.source",
}


def renamed(settings: list[tuple[str, Any]], quiet: bool = False) -> list[tuple[str, Any]]:
    """`settings` with each renamed key under its new name, and one line on stderr per old key given (none when
    `quiet`); ConfigError when an old key and its new one are given different values."""
    out, notes = [], {}
    for key, value in settings:
        new = RENAMED.get(key)
        if new is not None:
            clash = [v for k, v in settings if k == new and v != value]
            if clash:
                raise ConfigError(f"{key}={short(value)} and {new}={short(clash[0])} disagree: {key} is now {new}; "
                                  f"give {new} alone")
            notes[key] = f"grpolab: {key} is now {new} (read as {new}={value})"
            key = new
        out.append((key, value))
    if not quiet:
        for line in notes.values():
            print(line, file=sys.stderr)
    return out


def _coerce(key: str, value: Any, current: Any, ftype: str) -> Any:
    """Check `value` against the declared type of `key`; ints are accepted where floats are."""
    optional = "None" in ftype
    if value is None:
        if optional:
            return None
        raise ConfigError(f"{key}: must not be null (default is {current!r})")
    base = ftype.replace(" | None", "").strip()
    if base == "bool":
        if isinstance(value, bool):
            return value
    elif base == "int":
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif base == "float":
        number = None
        if isinstance(value, (int, float, str)) and not isinstance(value, bool):
            try:   # PyYAML reads '3e-5' (no dot) as a string
                number = float(value)
            except (ValueError, OverflowError):   # OverflowError: an int of 400 digits
                number = float("inf") if not isinstance(value, str) else None
        if number is not None:
            # inf/nan pass every `> 0` check and then poison the run (NaN weights, every step skipped)
            need(math.isfinite(number), f"{key}: must be a finite number, got {short(value)}")
            return number
    elif base == "str":
        if isinstance(value, str):
            return value
    elif base == "list":
        if isinstance(value, list):
            return value
        if isinstance(value, str):
            return [v.strip() for v in value.split(",") if v.strip()]
    else:
        return value
    raise ConfigError(f"{key}: expected {base}, got {value!r}")


def _set(cfg: Config, dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    sections = {f.name for f in dataclasses.fields(Config)}
    if len(parts) == 1 and parts[0] in sections:   # `rollout: 5` in a file, or rollout=5 on the command line
        need(value is None, _not_a_mapping(dotted, value))   # (an empty `rollout:` section sets nothing)
        return
    if len(parts) < 2 or parts[0] not in sections:
        raise ConfigError(f"unknown config key {dotted!r}; keys look like section.name with section one of "
                          f"{', '.join(sorted(sections))}")
    section = getattr(cfg, parts[0])
    if parts[:2] == ["reward", "judges"]:
        _set_judge(cfg, dotted, parts[2:], value)
        return
    if parts[:2] == ["data", "task_config"]:   # free-form: the task's own fields, checked when its rows are made
        if len(parts) == 2:
            need(value in (None, {}), f"{dotted}: give the task's fields, e.g. {dotted}.min_terms=2")
            cfg.data.task_config.clear()
        else:
            cfg.data.task_config[".".join(parts[2:])] = value
        return
    while len(parts) > 2 and dataclasses.is_dataclass(getattr(section, parts[1], None)):   # reward.code_exec.x
        section, parts = getattr(section, parts[1]), [f"{parts[0]}.{parts[1]}", *parts[2:]]
    if len(parts) != 2:
        raise ConfigError(f"unknown config key {dotted!r}")
    _set_field(section, parts[0], parts[1], dotted, value)


def _set_field(section, prefix: str, key: str, dotted: str, value: Any) -> None:
    """section.key = value, checked against its declared type; an unknown key names the closest one."""
    fields = {f.name: f for f in dataclasses.fields(section)}
    if key not in fields:
        close = difflib.get_close_matches(key, fields, n=1)
        hint = f"; did you mean {prefix}.{close[0]}?" if close else \
            f"; valid keys: {', '.join(prefix + '.' + k for k in fields)}"
        raise ConfigError(f"unknown config key {dotted!r}{hint}")
    if dataclasses.is_dataclass(getattr(section, key)):   # reward.code_exec: 5
        need(value is None, _not_a_mapping(dotted, value))
        return
    setattr(section, key, _coerce(dotted, value, getattr(section, key), str(fields[key].type)))


def _not_a_mapping(key: str, value: Any) -> str:
    return (f"{key}: is a section and must be a mapping of its keys (e.g. `{key}: {{name: value}}` in the file, "
            f"or {key}.name=value on the command line), got {short(value)}")


def _set_judge(cfg: Config, dotted: str, rest: list[str], value: Any) -> None:
    """reward.judges.<name>.<key> = value (a judge is created by its first key); reward.judges: {} clears."""
    judges = cfg.reward.judges
    if not rest:
        need(value in (None, {}), f"{dotted}: give each judge's keys, e.g. reward.judges.grader.base_url=...")
        judges.clear()
        return
    name = rest[0]
    need(bool(re.fullmatch(r"[A-Za-z0-9_-]+", name)), f"{dotted}: judge names are letters, digits, _ and -")
    if len(rest) == 1:   # reward.judges.<name>: {} (an empty mapping flattens to nothing)
        need(value in (None, {}), f"{dotted}: give the judge's keys, e.g. {dotted}.base_url=...")
        judges.setdefault(name, JudgeConfig())
        return
    if len(rest) != 2:
        raise ConfigError(f"unknown config key {dotted!r}")
    _set_field(judges.setdefault(name, JudgeConfig()), f"reward.judges.{name}", rest[1], dotted, value)


def _flatten(d: dict, prefix: str = "") -> dict:
    """{'rollout': {'temperature': 0.7}} -> {'rollout.temperature': 0.7} (a file's keys as overrides)."""
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out


def parse_override(text: str) -> tuple[str, Any]:
    """'section.key=value' -> (key, YAML-parsed value)."""
    if "=" not in text:
        raise ConfigError(f"override {text!r} must look like section.key=value")
    key, raw = text.split("=", 1)
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    if isinstance(value, str) and not raw.strip().startswith(("'", '"')):
        value = raw.strip()  # plain text as typed: YAML would cut 'Answer after ####' at the '#'
    return key.strip(), value


class _StrictLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing a key given twice in one mapping (PyYAML keeps the last one
    silently, so `lr: 1e-4` a few lines above `lr: 1e-2` would be lost without a word)."""

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen: dict = {}
            for key_node, _ in node.value:   # this mapping's own keys, before `<<:` merges add theirs
                if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node)
                line = key_node.start_mark.line + 1
                if key in seen:
                    raise ConfigError(f"line {line}: key {key!r} is given twice in one section (first on line "
                                      f"{seen[key]}); keep one")
                seen[key] = line
        return super().construct_mapping(node, deep=deep)


def read_yaml(path: str | Path) -> dict:
    """A config file's mapping of sections; ConfigError when it is missing, not UTF-8, not YAML, has a
    key twice or is not a mapping."""
    p = Path(path)
    if p.is_dir():
        raise ConfigError(f"config file {str(p)!r} is a directory; give a YAML file")
    if not p.is_file():
        raise ConfigError(f"config file {str(p)!r} not found")
    raw = p.read_bytes()
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = raw[:e.start].count(b"\n") + 1
        col = e.start - (raw.rfind(b"\n", 0, e.start) + 1) + 1
        raise ConfigError(f"config file {str(p)!r}: line {line} is not UTF-8 text (byte 0x{raw[e.start]:02x} at "
                          f"column {col}); save the file as UTF-8") from None
    try:
        data = yaml.load(text, Loader=_StrictLoader) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {str(p)!r} is not valid YAML: {str(e).splitlines()[0]}") from None
    except ConfigError as e:
        raise ConfigError(f"config file {str(p)!r}: {e}") from None
    except RecursionError:
        raise ConfigError(f"config file {str(p)!r}: nested too deeply to read (PyYAML recurses once per "
                          f"level); a config is sections of keys") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {str(p)!r} must hold a mapping of sections")
    _check_expanded(data, f"config file {str(p)!r}")
    return data


# values a config may hold once its YAML aliases (*name) are expanded: far above any real config, far below
# an alias bomb (nine levels of nine aliases each: 387 million), which the config's walks would expand forever
MAX_VALUES = 100_000


def _check_expanded(data, where: str) -> None:
    """ConfigError when `data`, with every alias expanded, holds more than MAX_VALUES values (counted over
    the shared objects once each, so the count itself costs nothing)."""
    sizes: dict[int, int] = {}

    def size(x) -> int:
        if id(x) not in sizes:
            sizes[id(x)] = 0   # (a cycle counts once)
            kids = list(x.keys()) + list(x.values()) if isinstance(x, dict) else x if isinstance(x, list) else []
            sizes[id(x)] = min(1 + sum(size(k) for k in kids), MAX_VALUES + 1)
        return sizes[id(x)]
    if size(data) > MAX_VALUES:
        raise ConfigError(f"{where}: its YAML aliases (*name) expand to more than {MAX_VALUES:,} values; a config "
                          f"is sections of keys")


def load_config(path: str | Path | None = None, overrides: list[str] | tuple = (),
                base: Config | None = None) -> Config:
    """Defaults (or `base`), then the YAML file, then `key=value` overrides; validated."""
    cfg = base or Config()
    if path is not None:
        p = Path(path)
        data = read_yaml(p)
        if "stages" in data:
            raise ConfigError(f"config file {str(p)!r} lists stages: run it with `grpolab pipeline {p}`")
        settings = list(_flatten(data).items())
    else:
        settings = []
    for o in overrides:   # 'optim={lr: 0.1}' is optim.lr=0.1, as the same mapping in a file would be
        key, value = parse_override(o)
        _check_expanded(value, f"override {key}")
        settings += list(_flatten(value, key + ".").items()) if isinstance(value, dict) and value else [(key, value)]
    return _apply(cfg, settings)


def config_from_dict(d: dict) -> Config:
    """A validated Config from a nested mapping of sections, as a config file holds them."""
    return _apply(Config(), list(_flatten(d).items()))


def _apply(cfg: Config, settings: list[tuple[str, Any]]) -> Config:
    """Set `settings` in order (renamed keys under their new names), after the algorithm preset they name
    (explicit keys win over it)."""
    settings = renamed(settings)
    preset = [v for k, v in settings if k == "algorithm.preset"]
    if preset and preset[-1] is not None:
        name = preset[-1]
        if name not in PRESETS:
            raise ConfigError(f"algorithm.preset: {name!r} is not one of {', '.join(PRESETS)}")
        for k, v in PRESETS[name].items():
            _set(cfg, k, v)
    for k, v in settings:
        _set(cfg, k, v)
    # eval.reward's default follows the training reward (eval_check); the run's config.yaml records the check used
    cfg.eval.reward = eval_check(cfg)
    validate(cfg)
    return cfg


def check_output_dir(cfg: Config) -> None:
    """train.output_dir can be created and written (checked before any work, as validate() checks
    values without touching the filesystem); ConfigError naming the key otherwise."""
    path = Path(cfg.train.output_dir)
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".grpolab_write_check_{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        existing = next((p for p in (path, *path.parents) if p.exists()), None)
        if existing is not None and not existing.is_dir():
            reason = f"{str(existing)!r} is a file, not a directory"
        else:
            reason = (e.strerror or type(e).__name__) + (f" ({str(e.filename)!r})" if e.filename else "")
        raise ConfigError(f"train.output_dir: cannot write the run directory {str(path)!r}: {reason}; "
                          f"give a writable directory") from None
