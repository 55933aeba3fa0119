"""Atomic small-file writes: the text goes to a temporary file beside `path`, then replaces it, so a
reader (or a crash) never sees half a file. And `writing_into`: the failures of writers that name no file."""

from __future__ import annotations

import contextlib
import errno
import json
import os
from collections.abc import Iterator
from pathlib import Path

from safetensors import SafetensorError


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


def says_disk_full(e: BaseException) -> bool:
    """safetensors' writer reports a full disk only in its message (os error 28)."""
    text = " ".join(str(e).split())
    return "os error 28" in text or "No space left" in text


def torch_write_failed(e: BaseException) -> bool:
    """torch.save's zip writer failing mid-file (a full disk, usually): 'PytorchStreamWriter failed writing
    file ...' or 'unexpected pos ...'."""
    return "PytorchStreamWriter failed" in str(e) or "unexpected pos" in str(e)


@contextlib.contextmanager
def writing_into(path: str | Path) -> Iterator[None]:
    """Inside: a full disk under safetensors' or torch.save's writers (which name no file, and safetensors no
    errno) becomes the OSError it is, naming `path` (the file or directory being written), for the CLI's line."""
    try:
        yield
    except SafetensorError as e:
        if not says_disk_full(e):
            raise
        raise OSError(errno.ENOSPC, "No space left on device", str(path)) from e
    except RuntimeError as e:
        if not torch_write_failed(e):
            raise
        raise OSError(errno.EIO, "writing failed (is the disk full?)", str(path)) from e
