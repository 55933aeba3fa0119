"""The step loop shared by the offline trainers (SFT, DPO, distillation).

One step: the next `batch_size` rows in a seeded order -> micro-batches -> each trainer's loss,
already divided by the whole batch's normalizer (loss tokens, pairs), so that accumulating over
micro-batches gives the full batch's gradient -> clip, AdamW step, scheduler -> metrics.jsonl,
periodic eval and checkpoint. A trainer subclass supplies `units`, `weight`, `micro_loss` and
`heldout`; everything else (order, optimizer, schedule, LoRA and master weights, checkpoints and
exact resume, Ctrl-C, trackers) is here, once.
"""

from __future__ import annotations

import contextlib
import json
import math
import time
from pathlib import Path

import torch

from ..monitor.console import PROGRESS_SECONDS, StepProgress
from ..monitor.trackers import Trackers
from ..data.stream import RowStream
from ..models import set_gradient_checkpointing
from ..models.lora import add_lora, has_lora, lora_config
from .finite_step import count_nonfinite, overflowed, restore, snapshot
from ..models.checkpoint import cut_logs, drop_final_eval, load_training_state, prune_checkpoints, save_checkpoint
from .master import MasterWeights
from .schedule import lr_factor
from .stop import StopFlag
from ..errors import TrainingError

BETAS = (0.9, 0.95)   # AdamW betas of the offline stages (the warm start's since the first release)


def total_steps(settings, n_rows: int) -> int:
    """Optimizer steps of a stage: `epochs` passes over the rows when set, else `steps`."""
    if getattr(settings, "epochs", 0):
        return settings.epochs * math.ceil(n_rows / settings.batch_size)
    return settings.steps


class OfflineTrainer:
    """Base of the SFT, DPO and distillation trainers. `settings` is the stage's config section
    (steps/epochs, batch_size, micro_batch_size, lr, lr_schedule, warmup_steps, weight_decay,
    max_grad_norm); `run_dir` None trains without writing anything (the demo's warm start)."""

    job = "offline"

    def __init__(self, cfg, settings, model, tokenizer, rows: list, *, run_dir: str | Path | None = None,
                 console=None, batch_hook=None) -> None:
        self.cfg, self.s, self.model, self.tok, self.rows = cfg, settings, model, tokenizer, rows
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self.console = console
        self.batch_hook = batch_hook   # (rows, step) -> rows: rewrites a batch before it is used
        m = cfg.model
        if m.lora_rank and not has_lora(model):
            add_lora(model, lora_config(m, model))
        self.lora = has_lora(model)
        if m.gradient_checkpointing:
            set_gradient_checkpointing(model, True)
        trained = [p for p in model.parameters() if p.requires_grad]
        self.master = MasterWeights(trained) if MasterWeights.needed(trained) else None
        self.opt = torch.optim.AdamW(self.master.master if self.master else trained, lr=settings.lr, betas=BETAS,
                                     weight_decay=settings.weight_decay)
        self.max_steps = total_steps(settings, len(rows))
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lambda s: lr_factor(
            s, settings.warmup_steps, self.max_steps, settings.lr_schedule, decay_start=0))
        self.stream = RowStream(len(rows), cfg.train.seed)
        self.step = 0
        self.bad_steps = 0
        self.device = next(model.parameters()).device
        self.wandb_run_id: str | None = None
        self.final_eval: dict | None = None   # held-out metrics after the last step (train(final_eval=True))
        # progress inside a long step (console output only); the warm start's `console` has no level
        talk = console is not None and getattr(console, "level", 1) >= 1
        self.progress = StepProgress(console.info if talk else None)

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
        self.progress.start_step(f"{self.job} step {self.step + 1}/{self.max_steps}")
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
        what = None
        if math.isfinite(norm) and math.isfinite(loss_sum):
            saved = snapshot(self.opt) if self.cfg.train.undo_nonfinite_updates else None
            self.opt.step()
            if self.master:
                self.master.weights_out()
            # a finite gradient can still overflow the weights (a huge lr): such weights are never saved
            if count_nonfinite(params) + (count_nonfinite(
                    p for p in self.model.parameters() if p.requires_grad) if self.master else 0):
                if saved is None:
                    raise TrainingError(
                        f"{self.job} step {self.step + 1}: {overflowed(loss_sum, norm, lr)}; stopped before saving "
                        f"them (the last checkpoint is kept). Lower {self.job}.lr, or set "
                        f"train.undo_nonfinite_updates=true to undo and count such updates")
                restore(self.opt, saved)
                if self.master:
                    self.master.weights_out()
                what = f"{overflowed(loss_sum, norm, lr)}; update undone"
        else:   # an update with NaN/inf would ruin the weights: skipped, and too many stop the run
            what = f"non-finite loss ({loss_sum}) or gradient norm ({norm}); update skipped"
        if what is not None:
            self.bad_steps += 1
            msg = (f"{self.job} step {self.step + 1}: {what} ({self.bad_steps} so far, "
                   f"train.max_bad_steps={self.cfg.train.max_bad_steps})")
            if self.bad_steps > self.cfg.train.max_bad_steps:
                raise TrainingError(msg + f"; lower {self.job}.lr or check the data")
            if self.console is not None:
                self.console.warn(msg)
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

    # ------------------------------------------------------------ the loop
    def train(self, final_eval: bool = False) -> list[dict]:
        """Run to the stage's last step; with a run directory, write metrics.jsonl, evaluate every
        train.eval_every steps, checkpoint every train.save_every steps and at the end. SIGINT/SIGTERM
        finish the step, save and raise KeyboardInterrupt (the first is acknowledged at once, a second stops
        at once). `final_eval` (with a run directory): after the final checkpoint, the held-out eval, logged
        with the last step's row and kept in `self.final_eval` (None when this call ran no step).
        A progress line with the ETA every 1/20 of the run (at least every train.log_every steps), and
        whenever PROGRESS_SECONDS have passed since the last one."""
        t = self.cfg.train
        history: list[dict] = []
        start, start_step = time.perf_counter(), self.step   # the ETA is this process's pace, also after a resume
        said = start
        files = self.run_dir is not None
        every = max(t.log_every, self.max_steps // 20)   # offline steps are quick: about 20 lines a run
        self.final_eval = None
        if files:
            self.run_dir.mkdir(parents=True, exist_ok=True)
        stop = StopFlag() if files else contextlib.nullcontext()
        trackers = Trackers(self.cfg, self.run_dir, start_step=self.step, wandb_run_id=self.wandb_run_id) \
            if files else contextlib.nullcontext()
        self.wandb_run_id = getattr(trackers, "wandb_run_id", None) or self.wandb_run_id
        out = open(self.run_dir / "metrics.jsonl", "a" if self.step else "w") if files else contextlib.nullcontext()
        pending, pending_at = None, 0   # the last step's row and where it starts in metrics.jsonl
        with trackers, out as f, self.progress:
            with stop:
                while self.step < self.max_steps:
                    m = self.train_step()
                    if files and t.eval_every and self.step % t.eval_every == 0 and self.step < self.max_steps:
                        m.update(self.evaluate())
                    history.append(m)
                    if files and final_eval and self.step == self.max_steps and stop.signal is None:
                        pending, pending_at = m, f.tell()
                    if files:   # written now: a crash in the final eval below loses no step
                        f.write(json.dumps(m) + "\n")
                        f.flush()
                        trackers.log(m, self.step)
                    if pending is not None:
                        break
                    now = time.perf_counter()
                    if self.console is not None and (self.step % every == 0 or self.step == self.max_steps
                                                     or now - said >= PROGRESS_SECONDS):
                        said = now
                        self.console.progress(self.job, self.step, self.max_steps, now - start,
                                              self.progress_parts(m), start_step=start_step)
                    if files and stop.signal is not None:
                        stop.hold()
                        self.save()
                        raise KeyboardInterrupt(f"stopped by {stop.signal} after {self.job} step {self.step}; "
                                                f"checkpoint saved, continue with train.resume=auto")
                    if files and t.save_every and self.step % t.save_every == 0 and self.step < self.max_steps:
                        self.save()
            if files:
                self.save()
            if pending is not None:   # the final checkpoint is safe first; then the held-out eval, in the last row
                self.final_eval = self.evaluate()
                pending.update(self.final_eval)
                f.seek(pending_at)   # the last step's row again, now with the eval (trackers: the eval alone)
                f.truncate()
                f.write(json.dumps(pending) + "\n")
                f.flush()
                trackers.log(self.final_eval, self.step)
                if self.console is not None:
                    self.console.progress(self.job, self.step, self.max_steps, time.perf_counter() - start,
                                          self.progress_parts(pending), start_step=start_step)
        return history

    def progress_parts(self, m: dict) -> list[str]:
        parts = [f"loss {m['loss']:.4f}"]
        parts += [f"{k.removeprefix('eval/')} {m[k]:.3f}" for k in ("eval/loss", "eval/greedy_accuracy") if k in m]
        return parts

    # ------------------------------------------------------------ checkpoints
    def extra_state(self) -> dict:
        return {}

    def restore_extra(self, state: dict) -> None:
        pass

    @property
    def ref_model(self):
        return None

    def save(self) -> Path:
        rng = {"torch": torch.get_rng_state()}
        if torch.cuda.is_available():
            rng["cuda"] = torch.cuda.get_rng_state_all()
        path = save_checkpoint(self.run_dir / "checkpoints", self.step, self.model, tokenizer=self.tok,
                               optimizer=self.opt, scheduler=self.sched, rng=rng, ref_model=self.ref_model,
                               master_weights=self.master.master if self.master else None,
                               trainer_state={"job": self.job, "stream": self.stream.state(), **self.extra_state(),
                                              **({"wandb_run_id": self.wandb_run_id} if self.wandb_run_id else {})})
        prune_checkpoints(self.run_dir / "checkpoints", self.cfg.train.keep_checkpoints)
        return path

    def restore(self, ckpt: str | Path, weights: bool = True) -> None:
        """Continue exactly from a checkpoint of this trainer: weights (unless the model was just
        loaded from it), reference, optimizer, scheduler, RNG, data position; logs cut back to its step.
        A batch hook is replayed over the earlier steps, so a stateful one (the warm start's mixer)
        is where it was."""
        state = load_training_state(ckpt, self.model if weights else None, self.ref_model)
        self.opt.load_state_dict(state["optimizer"])
        if self.master and state.get("master") is not None:
            self.master.load(state["master"])
        self.sched.load_state_dict(state["scheduler"])
        torch.set_rng_state(state["rng"]["torch"])
        if "cuda" in state["rng"] and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["rng"]["cuda"])
        tr = state["trainer"]
        self.step = tr["step"]
        if self.batch_hook is not None:   # replay: the hook sees the same batches as before
            stream = RowStream(len(self.rows), self.cfg.train.seed)
            for s in range(self.step):
                self.batch_hook([self.rows[i] for i in stream.next(self.s.batch_size)], s)
        self.stream.restore(tr["stream"])
        self.wandb_run_id = tr.get("wandb_run_id")
        self.restore_extra(tr)
        if self.run_dir is not None:
            cut_logs(self.run_dir, self.step)
            drop_final_eval(self.run_dir / "metrics.jsonl", self.step, self.cfg.train.eval_every)

