"""The configuration reference (docs/reference/configuration.md) is generated from the schema: it must be
current, name every key, and every key must have help text to show."""

import dataclasses
import importlib.util

from conftest import ROOT

from grpolab.config import Config, JudgeConfig

REFERENCE = ROOT / "docs" / "reference" / "configuration.md"


def _generator():
    spec = importlib.util.spec_from_file_location("config_table", ROOT / "scripts" / "config_table.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _keys(section, prefix: str):
    """Every leaf key under `section` (an instance): nested sections are walked, other values are keys."""
    for f in dataclasses.fields(section):
        value = getattr(section, f.name)
        if dataclasses.is_dataclass(value):   # a nested section: reward.code_exec.*
            yield from _keys(value, f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}"


def _fields(cls):
    """Every field of `cls` and of the sections below it (judges included: their dict starts empty)."""
    for f in dataclasses.fields(cls):
        yield cls, f
        value = getattr(cls(), f.name)
        if dataclasses.is_dataclass(value):
            yield from _fields(type(value))


def test_reference_is_current():
    assert REFERENCE.read_text() == _generator().render(), \
        "docs/reference/configuration.md is stale: run `python scripts/config_table.py`"


def test_reference_names_every_key():
    text = REFERENCE.read_text()
    keys = [*_keys(Config(), ""), *_keys(JudgeConfig(), "reward.judges.<name>.")]
    assert {"reward.code_exec.timeout", "reward.judges", "reward.judges.<name>.base_url", "sft.lr",
            "distill.max_grad_norm"} <= set(keys)
    missing = [k for k in keys if f"| `{k}` |" not in text]
    assert missing == [], f"keys missing from the reference: {missing}"


def test_every_key_has_help():
    fields = [*_fields(Config), *_fields(JudgeConfig)]
    assert len(fields) > 200
    empty = [f"{cls.__name__}.{f.name}" for cls, f in fields if not f.metadata.get("help", "").strip()]
    assert empty == [], f"keys without help text (give option(..., help)): {empty}"
