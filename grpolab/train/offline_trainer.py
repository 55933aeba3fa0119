"""The step of the offline trainers (SFT, DPO, RM, distillation), on the shell in train/base.py.

One step: the next `batch_size` rows in a seeded order -> micro-batches -> each trainer's loss,
already divided by the whole batch's normalizer (loss tokens, pairs), so that accumulating over
micro-batches gives the full batch's gradient -> clip, AdamW step, scheduler -> metrics row. A trainer
subclass supplies `units`, `weight`, `micro_loss` and `heldout`.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import torch

from ..data.stream import RowStream
from ..models import set_gradient_checkpointing
from .base import Trainer
from .schedule import lr_factor


def total_steps(settings, n_rows: int) -> int:
    """Optimizer steps of a stage: `epochs` passes over the rows when set, else `steps`."""
    if getattr(settings, "epochs", 0):
        return settings.epochs * math.ceil(n_rows / settings.batch_size)
    return settings.steps


class OfflineTrainer(Trainer):
    """Base of the SFT, DPO, RM and distillation trainers. `settings` is the stage's config section
    (steps/epochs, batch_size, micro_batch_size, lr, lr_schedule, warmup_steps, weight_decay,
    max_grad_norm); `run_dir` None trains without writing anything (the demo's warm start)."""

    job = "offline"

    def __init__(self, cfg, settings, model, tokenizer, rows: list, *, run_dir: str | Path | None = None,
                 console=None, batch_hook=None) -> None:
        # the warm start's `console` has no level: it talks
        super().__init__(cfg, model, tokenizer, run_dir, console,
                         talk=console is not None and getattr(console, "level", 1) >= 1)
        self.s, self.rows = settings, rows
        self.batch_hook = batch_hook   # (rows, step) -> rows: rewrites a batch before it is used
        self.attach_lora()
        if cfg.model.gradient_checkpointing:
            set_gradient_checkpointing(model, True)
        self.max_steps = total_steps(settings, len(rows))
        self.build_optimizer(settings.lr, (settings.beta1, settings.beta2), settings.weight_decay, lambda s: lr_factor(
            s, settings.warmup_steps, self.max_steps, settings.lr_schedule, decay_start=0))
        self.stream = RowStream(len(rows), cfg.train.seed)

    @property
    def lr_key(self) -> str:
        return f"{self.job}.lr"

    # ------------------------------------------------------------ what a trainer supplies
    def units(self, rows: list) -> list:
        """The step's rows as the things micro-batches are cut from (e.g. tokenized examples)."""
        return rows

    def weight(self, units: list) -> float:
        """This list's share of the batch normalizer (e.g. its loss tokens)."""
        return float(len(units))

    def micro_loss(self, units: list, total: float) -> tuple[torch.Tensor, dict[str, float]]:
        """(loss of these units divided by `total`, metric sums) with autograd on."""
        raise NotImplementedError

    def step_metrics(self, sums: dict[str, float], total: float) -> dict:
        """Metrics of a step from the summed `micro_loss` metrics."""
        return {k: v / max(total, 1e-12) for k, v in sums.items()}

    def heldout(self) -> dict:
        """Held-out metrics (eval/...), computed every train.eval_every steps and at the end."""
        return {}

    # ------------------------------------------------------------ one step
    def next_rows(self) -> list:
        rows = [self.rows[i] for i in self.stream.next(self.s.batch_size)]
        return self.batch_hook(rows, self.step) if self.batch_hook is not None else rows

    def train_step(self) -> dict:
        t0 = time.perf_counter()
        self.progress.start_step(f"{self.step_label(self.step + 1)}/{self.max_steps}")
        self.progress.start_phase("batch")
        units = self.units(self.next_rows())
        total = self.weight(units)
        mb = self.s.micro_batch_size or len(units)
        self.progress.start_phase("update", len(units))
        self.model.train()
        lr = self.opt.param_groups[0]["lr"]
        self.opt.zero_grad(set_to_none=True)
        self.model.zero_grad(set_to_none=True)
        sums: dict[str, float] = {}
        loss_sum = 0.0
        for i in range(0, len(units), mb):
            loss, part = self.micro_loss(units[i:i + mb], total)
            loss.backward()
            self.progress.add(rows=len(units[i:i + mb]))
            loss_sum += float(loss.detach())
            for k, v in part.items():
                sums[k] = sums.get(k, 0.0) + v
        if self.master:
            self.master.grads_in()
        params = self.master.master if self.master else [p for p in self.model.parameters() if p.requires_grad]
        norm = float(torch.nn.utils.clip_grad_norm_(params, self.s.max_grad_norm or float("inf")))
        self.apply_update(loss_sum, norm)
        self.sched.step()
        self.model.eval()
        self.step += 1
        self.progress.end_step()
        dt = time.perf_counter() - t0
        return {"step": self.step, "loss": loss_sum, **self.step_metrics(sums, total), "lr": lr, "grad_norm": norm,
                "epoch": self.stream.passes, "time/step": dt}

    def evaluate(self) -> dict:
        self.model.eval()
        return self.heldout()

    # ------------------------------------------------------------ checkpoints
    def extra_state(self) -> dict:
        return {"stream": self.stream.state()}

    def restore_extra(self, state: dict, ckpt: Path) -> None:
        """A batch hook is replayed over the earlier steps, so a stateful one (the warm start's mixer)
        is where it was."""
        if self.batch_hook is not None:   # replay: the hook sees the same batches as before
            stream = RowStream(len(self.rows), self.cfg.train.seed)
            for s in range(self.step):
                self.batch_hook([self.rows[i] for i in stream.next(self.s.batch_size)], s)
        self.stream.restore(state["stream"])
