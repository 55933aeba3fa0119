"""Optional metric sinks beside metrics.jsonl: TensorBoard scalars and Weights & Biases.

Each is imported only when the config asks for it, with a one-line fix when it is missing.
"""

from __future__ import annotations

import math
from pathlib import Path


class Trackers:
    """`with Trackers(cfg, run_dir) as t: t.log(metrics, step)`; closes its writers on exit."""

    def __init__(self, cfg, run_dir: str | Path) -> None:
        self.tb = self.wandb = None
        lg = cfg.log
        if lg.tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                raise ImportError("log.tensorboard needs the tensorboard package: pip install tensorboard") from None
            self.tb = SummaryWriter(log_dir=str(Path(run_dir) / "tensorboard"))
        if lg.wandb_project:
            try:
                import wandb
            except ImportError:
                raise ImportError("log.wandb_project needs wandb: pip install wandb") from None
            self.wandb = wandb.init(project=lg.wandb_project, config=cfg.to_dict(), dir=str(run_dir))

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
