"""Which checkpoint `train.resume` continues from: 'auto' finds the newest usable one in the run
directory (after the clean-up a crash mid-save needs, with unusable newer ones moved out of the way);
a path is checked as it is."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

from ..errors import CheckpointError
from ..models.checkpoint import (
    check_training_checkpoint,
    checkpoint_at,
    list_checkpoints,
    recover_checkpoints,
    set_aside,
)


def _warn(msg: str) -> None:
    print(f"warning: {msg}", file=sys.stderr, flush=True)


def find_resume_checkpoint(resume: str, output_dir: str | Path,
                           warn: Callable[[str], None] = _warn) -> Path | None:
    """train.resume: 'auto' -> the newest usable checkpoint under output_dir (None if there is none),
    after cleaning up what a crash mid-save left there; a newer one that fails its check
    (verify_checkpoint) is renamed unusable_step_N, with a warning, and the previous one is taken.
    Else the path, checked: a CheckpointError naming the file when it fails."""
    if resume == "auto":
        return _newest_usable(Path(output_dir) / "checkpoints", warn)
    p = checkpoint_at(Path(resume))
    if not (p / "trainer_state.json").is_file() or not (p / "optimizer.pt").is_file():
        raise FileNotFoundError(f"train.resume: {resume!r} is not a training checkpoint (checkpoints/step_N "
                                f"with trainer_state.json and optimizer.pt)")
    check_training_checkpoint(p)
    return p


def _newest_usable(root: Path, warn: Callable[[str], None]) -> Path | None:
    recover_checkpoints(root)
    found = list_checkpoints(root)
    bad = []
    for p in reversed(found):
        try:
            check_training_checkpoint(p)
        except CheckpointError as e:
            bad.append((p, e))
            continue
        # only now that a usable one is found: the unusable newer ones go out of the way (pruning
        # would otherwise count them and delete good ones); with none usable nothing is moved
        for q, e in bad:
            warn(f"train.resume=auto: {q.name} is unusable ({e}); moved it to {set_aside(q).name} and "
                 f"resuming from {p.name}")
        return p
    if bad:
        raise CheckpointError(f"train.resume=auto: no usable checkpoint under {root}; the newest: "
                              f"{bad[0][1]}") from None
    return None
