"""Optional metric sinks beside metrics.jsonl: TensorBoard scalars and Weights & Biases.

Each is imported only when the config asks for it, with a one-line fix when it is missing.
On resume (start_step > 0) TensorBoard drops every point after start_step (SummaryWriter's
purge_step: readers discard the interrupted run's later points), and wandb continues the run
whose id the checkpoint recorded (id=..., resume="allow").
"""

from __future__ import annotations

import math
from pathlib import Path


class Trackers:
    """`with Trackers(cfg, run_dir) as t: t.log(metrics, step)`; closes its writers on exit.

    `start_step`: the last step already done (0 for a fresh run); `wandb_run_id`: the wandb run to
    continue (None: a new one; its id is then `self.wandb_run_id`)."""

    def __init__(self, cfg, run_dir: str | Path, start_step: int = 0, wandb_run_id: str | None = None) -> None:
        self.tb = self.wandb = None
        self.wandb_run_id = wandb_run_id
        lg = cfg.log
        if lg.tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                raise ImportError("log.tensorboard needs the tensorboard package: pip install tensorboard") from None
            # purge_step: points at steps >= start_step + 1 written before (by an interrupted run, or an
            # earlier run in this directory) are discarded by TensorBoard, as metrics.jsonl is cut back
            self.tb = SummaryWriter(log_dir=str(Path(run_dir) / "tensorboard"), purge_step=start_step + 1)
        if lg.wandb_project:
            try:
                import wandb
            except ImportError:
                raise ImportError("log.wandb_project needs wandb: pip install wandb") from None
            resume = {"id": wandb_run_id, "resume": "allow"} if wandb_run_id else {}
            self.wandb = wandb.init(project=lg.wandb_project, config=cfg.to_dict(), dir=str(run_dir), **resume)
            self.wandb_run_id = self.wandb.id

    def log(self, metrics: dict, step: int) -> None:
        scalars = {k: float(v) for k, v in metrics.items()
                   if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}
        if self.tb is not None:
            for k, v in scalars.items():
                self.tb.add_scalar(k, v, step)
        if self.wandb is not None:
            self.wandb.log(scalars, step=step)

    def __enter__(self) -> "Trackers":
        return self

    def __exit__(self, *exc) -> None:
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()
