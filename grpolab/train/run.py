"""The run directory (train.output_dir) of one job, and what happens to it once, at the job's start:
taken (a lock), the checkpoint `train.resume` continues from found and checked (of this job, with only
the config changes resume_rules.py allows), config.yaml written. The rest of its life: the trainer writes
the logs and checkpoints (train/base.py; on resume the logs are cut back: run_logs.py), the job the
report."""

from __future__ import annotations

import atexit
import fcntl
import os
import shutil
from pathlib import Path

import yaml

from .. import distributed
from ..config import Config
from ..config.load import check_output_dir
from ..errors import ConfigError
from .resume_checkpoint import find_resume_checkpoint
from .resume_rules import check_resume_config, check_resume_job

# run directories this process holds (their lock files stay open, so locked, until the process ends)
_HELD: dict[str, object] = {}


class Run:
    """One job's run directory. `job`: the checkpoint job it resumes (grpo, sft, dpo, rm, distill; None:
    the checkpoint's own). Rank 0 takes the directory and looks up the checkpoint; the other ranks take
    its answer (the run directory is on a shared filesystem)."""

    def __init__(self, cfg: Config, job: str | None = None) -> None:
        self.cfg, self.job = cfg, job
        self.dir = Path(cfg.train.output_dir)
        self._looked_up = False   # this process looks the checkpoint up once: the lookup may repair the directory
        self._checkpoint: Path | None = None

    def start(self) -> None:
        """config.yaml of the run. With train.resume, first: the checkpoint to resume must be usable, of
        `job` (when given; else the checkpoint's job is assumed), and the config may change only the keys
        resume_rules.py allows, so config.yaml keeps describing the weights (ConfigError listing the keys)."""
        check_output_dir(self.cfg)   # before any work: an unwritable train.output_dir is a config error naming the key
        if not distributed.world_from_env().main:
            return
        self.lock()
        text = yaml.safe_dump(self.cfg.to_dict(), sort_keys=False)
        ckpt = self.find_checkpoint()
        if ckpt is not None:   # before config.yaml is rewritten: a refused resume leaves it as it was
            if self.job is not None:
                check_resume_job(ckpt, self.job)
            check_resume_config(yaml.safe_load(text), ckpt, self.job)
        if not (self.dir / "config.yaml").exists():
            atexit.register(_drop_if_unstarted, self.dir, {p.name for p in self.dir.iterdir()} | {".lock"})
        (self.dir / "config.yaml").write_text(text)

    def find_checkpoint(self) -> Path | None:
        """The checkpoint train.resume names (None: a fresh run), looked up once by this process."""
        if not self._looked_up:
            resume = self.cfg.train.resume
            self._checkpoint = find_resume_checkpoint(resume, self.dir) if resume else None
            self._looked_up = True
        return self._checkpoint

    def resume_checkpoint(self) -> Path | None:
        """The checkpoint to continue from, on every rank: rank 0's, of this run's job."""
        ckpt = self.find_checkpoint() if distributed.world_from_env().main else None
        ckpt = distributed.broadcast_object(ckpt)
        if self.job is not None:
            check_resume_job(ckpt, self.job)
        return ckpt

    def lock(self) -> None:
        """Take the run directory for this process: an exclusive flock on .lock, held until the process ends (the
        kernel releases it on any death, a SIGKILL included). ConfigError naming the directory and the other
        process's pid when another grpolab process holds it: two runs writing one directory would resume into
        each other's checkpoints."""
        key = str(self.dir.resolve())
        if key in _HELD:
            return
        f = open(self.dir / ".lock", "a+")
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            pid = f.read().strip() or "unknown"
            f.close()
            raise ConfigError(f"train.output_dir: {self.dir} is in use by another grpolab run (pid {pid}); wait for "
                              f"it to end, or give another train.output_dir") from None
        f.seek(0)
        f.truncate()
        f.write(str(os.getpid()))
        f.flush()
        _HELD[key] = f


def held_lock(run_dir: str | Path) -> int | None:
    """The file descriptor of this process's lock on `run_dir`, or None."""
    f = _HELD.get(str(Path(run_dir).resolve()))
    return None if f is None else f.fileno()


def adopt_lock(run_dir: str | Path, fd: int) -> None:
    """Hold `run_dir` through `fd`, the lock's file inherited from the process that took it (a flock belongs to
    the open file, so parent and child hold the same lock): the Python API's trainer takes it before it writes the
    run's inputs, then may run the job in a child (api/child.py)."""
    _HELD[str(Path(run_dir).resolve())] = os.fdopen(fd, "a+")


def _drop_if_unstarted(run_dir: Path, before: set[str]) -> None:
    """At exit: a run refused while it was being set up (its data, reward, model) wrote only config.yaml and
    the lock beside what `before` names; remove config.yaml (and the directory, when only the lock was
    there before), so no run seems to exist there."""
    try:
        if {p.name for p in run_dir.iterdir()} <= before | {"config.yaml"}:
            if before == {".lock"}:
                shutil.rmtree(run_dir)
            else:
                (run_dir / "config.yaml").unlink(missing_ok=True)
    except OSError:   # already gone, or not ours to remove: leave it
        pass
