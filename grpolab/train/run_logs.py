"""A run's jsonl logs (metrics.jsonl, samples.jsonl) brought back to a checkpoint's step when the run
resumes from it: it writes the later lines again."""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import CheckpointError
from ..utils.files import write_atomic


def rewind_logs(run_dir: Path, step: int, *, continues: bool, eval_every: int) -> None:
    """Resuming at `step`: the lines after it go; `continues` (the run goes on past `step`): that step's
    final eval goes too (a finished run's last row keeps it)."""
    cut_logs(run_dir, step)
    if continues:
        drop_final_eval(run_dir / "metrics.jsonl", step, eval_every)


def cut_logs(run_dir: str | Path, step: int, names: tuple[str, ...] = ("metrics.jsonl", "samples.jsonl")) -> None:
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
