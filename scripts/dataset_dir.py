"""Reading and writing a dataset directory of jsonl splits (what data.train_path takes)."""

from __future__ import annotations

import json
from pathlib import Path


def read_rows(path: Path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def write_dataset(out: Path, splits: dict[str, list[dict]]) -> None:
    """OUT/<split>.jsonl for each split, each written to a .partial file first (no half file on a crash)."""
    out.mkdir(parents=True, exist_ok=True)
    for name, rows in splits.items():
        tmp = out / f"{name}.jsonl.partial"
        with open(tmp, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
        tmp.replace(out / f"{name}.jsonl")
