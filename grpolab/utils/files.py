"""Atomic small-file writes: the text goes to a temporary file beside `path`, then replaces it, so a
reader (or a crash) never sees half a file."""

from __future__ import annotations

import json
import os
from pathlib import Path


def write_atomic(path: str | Path, text: str) -> None:
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_text(text)
    except OSError:   # e.g. the disk is full: leave no half-written .tmp beside the intact file
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, path)


def write_json(path: str | Path, obj) -> None:
    write_atomic(path, json.dumps(obj, indent=2))
