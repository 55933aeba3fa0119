"""A run's jsonl logs (metrics.jsonl, samples.jsonl) brought back to a checkpoint's step when the run
resumes from it: it writes the later lines again. Each checkpoint keeps a copy of the lines its own step
wrote (trainer_state.json's "logs"), so a line of that step torn or lost by a crash is written again from it
and no step goes missing."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path

from ..errors import CheckpointError
from ..utils.files import write_atomic

LOGS = ("metrics.jsonl", "samples.jsonl")


def _warn(msg: str) -> None:
    print(f"warning: {msg}", file=sys.stderr, flush=True)


def rewind_logs(run_dir: Path, step: int, *, continues: bool, eval_every: int, carried: dict | None = None,
                warn: Callable[[str], None] = _warn) -> None:
    """Resuming at `step`: the lines after it go; the lines of `step` the checkpoint `carried` ({log name:
    records}) come back where the file holds fewer; `continues` (the run goes on past `step`): that step's
    final eval goes too (a finished run's last row keeps it). A metrics row of `step` still missing (a
    checkpoint of an older grpolab keeps no copy) is said in a warning."""
    cut_logs(run_dir, step)
    for name, records in (carried or {}).items():
        if name in LOGS and isinstance(records, list):
            restore_step(Path(run_dir) / name, step, records)
    if continues:
        drop_final_eval(run_dir / "metrics.jsonl", step, eval_every)
    metrics = Path(run_dir) / "metrics.jsonl"
    if step and metrics.exists() and step not in {_log_step(ln) for ln in metrics.read_text().splitlines()}:
        warn(f"{metrics}: the row of step {step} was lost (a crash tore it) and checkpoints/step_{step} keeps no "
             f"copy of it (written by an older grpolab); the run goes on without that row")


def restore_step(path: Path, step: int, records: list[dict]) -> None:
    """A log already cut back to `step`: when it holds fewer lines of `step` than `records` (the ones that step
    wrote, as its checkpoint keeps them), its lines of `step` are replaced by `records`; rewritten atomically."""
    records = [r for r in records if isinstance(r, dict) and r.get("step") == step]
    if not records or not path.exists():
        return
    lines = path.read_text().splitlines()
    if sum(_log_step(ln) == step for ln in lines) >= len(records):
        return
    keep = [ln for ln in lines if _log_step(ln) != step]
    write_atomic(path, "".join(ln + "\n" for ln in keep) + "".join(json.dumps(r) + "\n" for r in records))


def cut_logs(run_dir: str | Path, step: int, names: tuple[str, ...] = LOGS) -> None:
    """Drop the lines of a run's jsonl logs written after `step` (a resumed run writes them again).
    A torn last line (a crash mid-append) is dropped, as `grpolab generate` does; a broken line
    before it is a CheckpointError naming the file and line."""
    for name in names:
        path = Path(run_dir) / name
        if path.exists():
            lines = [(n, ln) for n, ln in enumerate(path.read_text(errors="replace").splitlines(), 1) if ln.strip()]
            keep = []
            for i, (n, ln) in enumerate(lines):
                found = _log_step(ln)
                if found is None:
                    if i == len(lines) - 1:   # torn by a crash mid-write
                        break
                    raise CheckpointError(f"{path}: line {n} is not a log record (a JSON object with a step); "
                                          f"delete that line and resume again")
                if found <= step:
                    keep.append(ln)
            write_atomic(path, "".join(ln + "\n" for ln in keep))


def _log_step(line: str) -> int | None:
    try:
        rec = json.loads(line)
    except (json.JSONDecodeError, RecursionError):
        return None
    step = rec.get("step") if isinstance(rec, dict) else None
    return step if isinstance(step, int) else None


def last_row(path: Path) -> tuple[dict | None, int]:
    """The last line of a jsonl log as a JSON object, and the byte offset where that line starts; (None, 0) when
    there is none."""
    data = path.read_bytes().rstrip(b"\n") if path.exists() else b""
    at = data.rfind(b"\n") + 1
    try:
        row = json.loads(data[at:]) if data else None
    except ValueError:
        return None, 0
    return (row, at) if isinstance(row, dict) else (None, 0)


def drop_final_eval(path: Path, step: int, eval_every: int) -> None:
    """Continuing a finished run past `step`: remove the eval/* keys (and the watch/* keys logged with them)
    from `step`'s row, the last one of metrics.jsonl, unless train.eval_every evaluates at that step anyway (an
    unbroken run has no eval there otherwise); rewritten atomically, and only when there are any."""
    if (eval_every and step % eval_every == 0) or not path.exists():
        return
    lines = path.read_text().splitlines(keepends=True)
    if not lines:
        return
    row = json.loads(lines[-1])
    if row.get("step") != step or not any(k.startswith("eval/") for k in row):
        return
    lines[-1] = json.dumps({k: v for k, v in row.items() if not k.startswith(("eval/", "watch/"))}) + "\n"
    write_atomic(path, "".join(lines))

