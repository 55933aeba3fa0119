"""What every job shares: torch set up per rank, the console, the run's config.yaml and resume check,
the report."""

from __future__ import annotations

import atexit
import fcntl
import os
import shutil
from pathlib import Path

import torch
import yaml

from .. import distributed
from ..config import Config
from ..config.load import check_output_dir
from ..determinism import pin_cpu_numerics, pin_cuda_numerics
from ..errors import ConfigError
from ..models.checkpoint import checkpoint_job, find_resume_checkpoint
from ..models.hf import resolve_device
from ..monitor.console import Console
from ..monitor.report import write_report
from ..train.resume_rules import check_resume_config

EVAL_KEYS = ("greedy_accuracy", "pass@1", "pass@8", "tool_calls_per_completion")


def setup_torch(cfg: Config) -> None:
    """Join the process group when launched with several ranks; fixed thread count (several ranks
    on one machine share its cores), MKL's dynamic threading off, seeded: same bits on an idle or
    busy machine."""
    world = distributed.init(cfg.model.device)
    threads = cfg.train.threads
    if world.size > 1 and not threads:
        threads = max(1, (os.cpu_count() or 1) // world.local_size)
    pin_cpu_numerics(threads)
    if cfg.train.cuda_deterministic and resolve_device(cfg.model.device).type == "cuda":
        pin_cuda_numerics()
    torch.manual_seed(cfg.train.seed)


def model_device(cfg: Config) -> str:
    """model.device for this process: with several ranks, 'cuda' is cuda:LOCAL_RANK."""
    return distributed.rank_device(cfg.model.device, distributed.world_from_env())


def make_console(cfg: Config) -> Console:
    """Rank 0 talks; the other ranks stay quiet (errors still reach stderr)."""
    return Console(level=cfg.log.level) if distributed.world_from_env().main else Console(quiet=True)


# run directories this process holds (their lock files stay open, so locked, until the process ends)
_HELD: dict[str, object] = {}


def lock_run_dir(run_dir: Path) -> None:
    """Take the run directory for this process: an exclusive flock on run_dir/.lock, held until the process
    ends (the kernel releases it on any death, a SIGKILL included). ConfigError naming the directory and the
    other process's pid when another grpolab process holds it: two runs writing one directory would resume
    into each other's checkpoints."""
    key = str(run_dir.resolve())
    if key in _HELD:
        return
    f = open(run_dir / ".lock", "a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        pid = f.read().strip() or "unknown"
        f.close()
        raise ConfigError(f"train.output_dir: {run_dir} is in use by another grpolab run (pid {pid}); wait for it "
                          f"to end, or give another train.output_dir") from None
    f.seek(0)
    f.truncate()
    f.write(str(os.getpid()))
    f.flush()
    _HELD[key] = f


def write_run_config(cfg: Config, run_dir: Path, job: str | None = None) -> None:
    """config.yaml of the run. With train.resume, first: the checkpoint to resume must be usable, of
    `job` (when given; else the checkpoint's job is assumed), and the config may change only the keys
    resume_rules.py allows, so config.yaml keeps describing the weights (ConfigError listing the keys)."""
    check_output_dir(cfg)   # before any work: an unwritable train.output_dir is a config error naming the key
    if distributed.world_from_env().main:
        lock_run_dir(run_dir)
        text = yaml.safe_dump(cfg.to_dict(), sort_keys=False)
        ckpt = find_resume_checkpoint(cfg.train.resume, run_dir) if cfg.train.resume else None
        if ckpt is not None:   # before config.yaml is rewritten: a refused resume leaves it as it was
            if job is not None:
                check_resume_job(ckpt, job)
            check_resume_config(yaml.safe_load(text), ckpt, job)
        if not (run_dir / "config.yaml").exists():
            atexit.register(_drop_if_unstarted, run_dir, {p.name for p in run_dir.iterdir()} | {".lock"})
        (run_dir / "config.yaml").write_text(text)


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


def check_resume_job(ckpt: str | Path | None, job: str) -> None:
    """A checkpoint to resume must come from the same job (grpo, sft, dpo, distill); ConfigError otherwise.
    Checkpoints without a job (older GRPO ones) count as grpo."""
    if ckpt is None:
        return
    found = checkpoint_job(ckpt)
    if found != job:
        raise ConfigError(f"train.resume: {ckpt} is a {found} checkpoint, not a {job} one; start {job} from it with "
                          f"model.init_from={ckpt}")


def write_run_report(run_dir: Path, console: Console) -> None:
    console.result(f"report: {write_report(run_dir)}")
