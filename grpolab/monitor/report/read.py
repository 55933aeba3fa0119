"""Reading a run directory for the report: metrics rows, JSON files, numeric series by step."""

from __future__ import annotations

import json
import math
from pathlib import Path

from ...errors import DataError


def read_jsonl(path: Path) -> list[dict]:
    """JSON objects, one a line; blank lines and a torn last line (a run still writing) are skipped. A line
    that is not JSON elsewhere is a DataError naming the file and the line (the CLI's one line, exit 2)."""
    rows = []
    if not path.exists():
        return rows
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError:
            if i == len(lines) - 1:
                continue
            raise DataError(f"{path}: line {i + 1} is not JSON ({line[:40]!r}); fix or remove that line") from None
        if isinstance(obj, dict):
            rows.append(obj)
    return rows


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


