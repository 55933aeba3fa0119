"""What every job shares: torch set up per rank, the console, the report. The run directory (lock,
resume, config.yaml) is train/run.py's Run."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from .. import distributed
from ..config import Config
from ..determinism import pin_cpu_numerics, pin_cuda_numerics
from ..models.hf import resolve_device
from ..monitor.console import Console
from ..monitor.report import write_report

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


def write_run_report(run_dir: Path, console: Console) -> None:
    console.result(f"report: {write_report(run_dir)}")
