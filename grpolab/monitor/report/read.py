"""Reading a run directory for the report: metrics rows, JSON files, numeric series by step."""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Callable
from pathlib import Path

from ...errors import DataError


def read_jsonl(path: Path, warn: Callable[[str], None] | None = None) -> list[dict]:
    """JSON objects, one a line; blank lines are skipped, and so is a last line that is torn or not a JSON object
    (a run still writing, or killed mid-line), said through `warn` (default: a warning on stderr) with its
    number. Such a line elsewhere is a DataError naming the file and the line (the CLI's one line, exit 2)."""
    rows = []
    if not path.exists():
        return rows
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    last = max((i for i, line in enumerate(lines) if line.strip()), default=-1)
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError:
            obj = _NOT_JSON
        if isinstance(obj, dict):
            rows.append(obj)
            continue
        what = "is not JSON" if obj is _NOT_JSON else "is not a JSON object"
        if i != last:
            raise DataError(f"{path}: line {i + 1} {what} ({line[:40]!r}); fix or remove that line")
        (warn or _warn)(f"{path}: skipped its last line, line {i + 1}: it {what} ({line[:40]!r}; torn by a run "
                        f"still writing or killed mid-line)")
    return rows


_NOT_JSON = object()


def _warn(msg: str) -> None:
    print(f"warning: {msg}", file=sys.stderr, flush=True)


def read_json(path: Path):
    if not path.exists():
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None


def num(v) -> float | None:
    """A finite float, or None for missing / NaN / inf / non-numeric values."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    v = float(v)
    return v if math.isfinite(v) else None


def step_values(rows: list[dict]) -> list[float]:
    return [float(r["step"]) if num(r.get("step")) is not None else float(i + 1) for i, r in enumerate(rows)]


def series(rows: list[dict], key: str) -> tuple[list[float], list[float]]:
    """(steps, values) where the row has a finite value for `key`."""
    xs, ys = [], []
    for x, r in zip(step_values(rows), rows):
        v = num(r.get(key))
        if v is not None:
            xs.append(x)
            ys.append(v)
    return xs, ys


def metric_keys(rows: list[dict]) -> list[str]:
    seen: dict[str, None] = {}
    for r in rows:
        for k in r:
            seen.setdefault(k, None)
    return list(seen)


