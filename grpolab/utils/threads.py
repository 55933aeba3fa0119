"""Calls run in daemon threads under one deadline: a call that hangs cannot keep the caller, or the process, alive."""

from __future__ import annotations

import threading
import time
from typing import Callable


def call_all(calls: list[Callable[[], object]], timeout: float | None, name: str) -> list[tuple[bool | None, object]]:
    """Run every call at once, each in a daemon thread named `name`; per call (True, its value), (False, the
    exception it raised) or (None, None) when it had not returned `timeout` seconds from the start (None or 0:
    no limit)."""
    boxes: list[dict] = [{} for _ in calls]
    events = [threading.Event() for _ in calls]

    def run(fn, box, ev) -> None:
        try:
            box["v"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed back to the caller's thread
            box["e"] = e
        finally:
            ev.set()

    for fn, box, ev in zip(calls, boxes, events):
        threading.Thread(target=run, args=(fn, box, ev), name=name, daemon=True).start()
    deadline = time.monotonic() + timeout if timeout else None
    out: list[tuple[bool | None, object]] = []
    for box, ev in zip(boxes, events):
        if not ev.wait(None if deadline is None else max(0.0, deadline - time.monotonic())):
            out.append((None, None))
        else:
            out.append((True, box["v"]) if "v" in box else (False, box["e"]))
    return out
