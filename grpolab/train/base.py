"""The trainer shell: everything a trainer does besides its step, once.

It owns the loop (metrics.jsonl with the final eval folded into the last row, periodic eval and
checkpoints, the console's progress), SIGINT/SIGTERM (finish the step, save, stop), the trackers,
checkpoints and exact resume, LoRA and float32 master weights, and what follows a non-finite update
(skip or undo it, count it, stop after train.max_bad_steps). A trainer subclass supplies `train_step`
(one step, returning its metrics row) and `evaluate` (held-out metrics), plus whatever extra state its
checkpoints keep; train/offline_trainer.py is the micro-batched supervised step of SFT, DPO, RM and
distillation, train/grpo.py the RL step.
"""

from __future__ import annotations

import contextlib
import json
import math
import time
from collections.abc import Callable
from pathlib import Path

import torch

from .. import distributed as dist
from ..errors import TrainingError
from ..models.checkpoint import load_training_state, prune_checkpoints, save_checkpoint
from ..models.lora import add_lora, has_lora, lora_config
from ..monitor.console import PROGRESS_SECONDS, StepProgress
from ..monitor.trackers import Trackers
from .callbacks import Hooks
from .finite_step import count_nonfinite, overflowed, params_of, restore, snapshot
from .master import MasterWeights
from .run_logs import last_row, rewind_logs
from .stop import StopFlag


class Trainer:
    """`run_dir` None trains without writing, evaluating or checkpointing (the demo's warm start);
    `writes` False: another process (rank 0) writes the run's files, this one only takes part."""

    job = "train"              # the checkpoint's job, and the name in console lines and messages
    collective = False         # skip/undo and stop are decided over every rank (distributed.sum_floats)
    lr_key = "optim.lr"        # the config key a message about a diverging update points to
    bad_data = "check the data"

    def __init__(self, cfg, model, tokenizer, run_dir: str | Path | None, console, *, talk: bool,
                 writes: bool = True) -> None:
        self.cfg, self.model, self.tok = cfg, model, tokenizer
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self.writes = self.run_dir is not None and writes
        self.console = console
        self.progress = StepProgress(console.info if talk else None)   # inside a long step: output, never numbers
        self.device = next(model.parameters()).device
        self.ref = None            # a frozen reference policy, saved with the checkpoints when there is one
        self.master: MasterWeights | None = None
        self.lora = has_lora(model)
        self.max_steps = 0
        self.step = 0
        self.bad_steps = 0
        self.wandb_run_id: str | None = None   # kept in checkpoints: a resumed run continues the same wandb run
        self.final_eval: dict | None = None    # the held-out eval after the last step (train(final_eval=True))
        # what this step wrote to each jsonl log, kept in its checkpoint: a line torn by a crash is written again
        self.step_logs: dict[str, list[dict]] = {}

    # ------------------------------------------------------------ setup
    def attach_lora(self) -> None:
        """model.lora_rank: adapters on the blocks, the rest frozen (a checkpoint may bring its own)."""
        m = self.cfg.model
        if m.lora_rank and not has_lora(self.model):
            add_lora(self.model, lora_config(m, self.model))
        self.lora = has_lora(self.model)

    def build_optimizer(self, lr: float, betas: tuple[float, float], weight_decay: float,
                        lr_lambda: Callable[[int], float], master: bool = True) -> None:
        """AdamW over the trained parameters only (no state for frozen ones), through float32 master
        copies when the weights are bfloat16/float16 (train/master.py); a LambdaLR schedule."""
        trained = [p for p in self.model.parameters() if p.requires_grad]
        self.master = MasterWeights(trained) if master and MasterWeights.needed(trained) else None
        self.opt = torch.optim.AdamW(self.master.master if self.master else trained, lr=lr, betas=betas,
                                     weight_decay=weight_decay)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lr_lambda)

    # ------------------------------------------------------------ what a trainer supplies
    def train_step(self) -> dict:
        """One step; returns its metrics row (self.step already advanced)."""
        raise NotImplementedError

    def evaluate(self) -> dict:
        """Held-out metrics."""
        raise NotImplementedError

    def eval_row(self, res: dict) -> dict:
        """`evaluate`'s metrics as they go into a metrics row."""
        return res

    def run_eval(self, final: bool) -> dict:
        """`evaluate` inside the loop (every train.eval_every steps, and the final one)."""
        return self.evaluate()

    def step_label(self, n: int) -> str:
        return f"{self.job} step {n}"

    def log_row(self, m: dict, f, trackers, elapsed: float, start_step: int) -> None:
        """A step's row to metrics.jsonl and the trackers (the writing process only)."""
        self.step_logs = {"metrics.jsonl": [dict(m)]}
        f.write(json.dumps(m) + "\n")
        f.flush()
        trackers.log(m, self.step)

    def show_progress(self, m: dict, start: float, start_step: int, force: bool = False) -> None:
        """A progress line with the ETA every 1/20 of the run (at least every train.log_every steps), and
        whenever PROGRESS_SECONDS have passed since the last one."""
        now = time.perf_counter()
        every = max(self.cfg.train.log_every, self.max_steps // 20)
        if self.console is not None and (force or self.step % every == 0 or self.step == self.max_steps
                                         or now - self._said >= PROGRESS_SECONDS):
            self._said = now
            self.console.progress(self.job, self.step, self.max_steps, now - start, self.progress_parts(m),
                                  start_step=start_step)

    def progress_parts(self, m: dict) -> list[str]:
        parts = [f"loss {m['loss']:.4f}"]
        parts += [f"{k.removeprefix('eval/')} {m[k]:.3f}" for k in ("eval/loss", "eval/greedy_accuracy") if k in m]
        return parts

    def fresh_run(self) -> None:
        """A run starting at step 0 (the writing process): clear what an earlier run left."""

    # ------------------------------------------------------------ non-finite updates
    def _sum(self, *xs: float) -> list[float]:
        return dist.sum_floats(*xs) if self.collective else list(xs)

    def apply_update(self, loss: float, norm: float) -> bool:
        """The optimizer step for gradients already clipped to `norm`, unless the loss or the norm is
        NaN/inf (skipped: such an update would ruin the weights). A finite gradient can still overflow
        the weights (a huge lr): such weights are never saved; the run stops, or with
        train.undo_nonfinite_updates the update is undone. Skipped and undone updates are counted, and
        too many stop the run. Returns whether the update was applied."""
        if not (math.isfinite(norm) and math.isfinite(self._sum(loss)[0])):
            self._bad_step(loss, norm)
            return False
        saved = snapshot(self.opt) if self.cfg.train.undo_nonfinite_updates else None
        self.opt.step()
        if self.master:
            self.master.weights_out()
        bad = count_nonfinite(params_of(self.opt)) + (
            count_nonfinite(p for p in self.model.parameters() if p.requires_grad) if self.master else 0)
        if self._sum(float(bad))[0] > 0:
            if saved is None:
                raise TrainingError(
                    f"{self.step_label(self.step + 1)}: {overflowed(loss, norm, self.opt.param_groups[0]['lr'])}; "
                    f"stopped before saving them (the last checkpoint is kept). Lower {self.lr_key}, or set "
                    f"train.undo_nonfinite_updates=true to undo and count such updates")
            restore(self.opt, saved)
            if self.master:
                self.master.weights_out()
            self._bad_step(loss, norm, weights=True)
            return False
        return True

    def _bad_step(self, loss: float, norm: float, weights: bool = False) -> None:
        self.opt.zero_grad(set_to_none=True)
        self.model.zero_grad(set_to_none=True)
        self.bad_steps += 1
        limit = self.cfg.train.max_bad_steps
        what = (f"{overflowed(loss, norm, self.opt.param_groups[0]['lr'])}; update undone" if weights else
                f"non-finite loss ({loss}) or gradient norm ({norm}); update skipped")
        msg = f"{self.step_label(self.step + 1)}: {what} ({self.bad_steps} so far, train.max_bad_steps={limit})"
        if self.bad_steps > limit:
            raise TrainingError(msg + f"; lower {self.lr_key} or {self.bad_data}")
        if self.console is not None:
            self.console.warn(msg)

    # ------------------------------------------------------------ the loop
    def train(self, final_eval: bool = False, hooks: Hooks | None = None) -> list[dict]:
        """Run to the last step; returns this call's step metrics. With a run directory: metrics.jsonl,
        evaluate every train.eval_every steps, checkpoint every train.save_every steps and at the end.
        SIGINT/SIGTERM finish the step, save and raise KeyboardInterrupt (the first is acknowledged at
        once, a second stops at once). `final_eval` (with a run directory): after the final checkpoint,
        the held-out eval, logged with the last step's row (metrics.jsonl, TensorBoard, wandb) and kept in
        `self.final_eval` (None when this call ran no step). `hooks`: a Python caller's callbacks (callbacks.py);
        one that sets control.should_training_stop ends the run after that step, saved as at the end."""
        t = self.cfg.train
        self.hooks = hooks = hooks or Hooks()
        history: list[dict] = []
        start, start_step = time.perf_counter(), self.step   # the ETA is this process's pace, also after a resume
        self._said = start
        run, files = self.run_dir is not None, self.writes
        self.final_eval = None
        stop, trackers, out = self._run_logs(run, files)
        # the last step's row and where it starts in metrics.jsonl, for the final eval to be folded into
        pending, pending_at = self._unevaluated_last_row(final_eval)
        with trackers, out as f, self.progress:
            hooks.begin(self.step, self.max_steps)
            with stop:
                while self.step < self.max_steps:
                    m = self.train_step()
                    if run and t.eval_every and self.step % t.eval_every == 0 and self.step < self.max_steps:
                        evals = self.eval_row(self.run_eval(final=False))
                        m.update(evals)
                        hooks.evaluated(self.step, evals)
                    history.append(m)
                    # a signal seen by any rank stops every rank after the same step
                    stopping = run and self._sum(float(stop.signal is not None))[0] > 0
                    if run and final_eval and self.step == self.max_steps and not stopping:
                        pending, pending_at = m, (f.tell() if files else 0)
                    if files:   # written now: a crash in the final eval below loses no step
                        self.log_row(m, f, trackers, time.perf_counter() - start, start_step)
                    hooks.step_end(self.step, m)
                    if pending is not None:
                        break
                    self.show_progress(m, start, start_step)
                    if stopping:
                        stop.hold()     # a second signal (the launcher's, as other ranks exit) must not cut the save
                        self.save()
                        if self.collective:
                            dist.barrier()   # no rank exits before rank 0 has saved
                        raise KeyboardInterrupt(f"stopped by {stop.signal or 'a signal to another rank'} after "
                                                f"{self.step_label(self.step)}; checkpoint saved, continue with "
                                                f"train.resume=auto")
                    if hooks.callbacks and self._sum(float(hooks.stop))[0] > 0:   # every rank stops at one step
                        break
                    if run and t.save_every and self.step % t.save_every == 0 and self.step < self.max_steps:
                        self.save()
                        hooks.saved()
            if run:
                self.save()
                hooks.saved()
            if pending is not None:   # the final checkpoint is safe first; then the held-out eval, in the last row
                self._fold_final_eval(pending, pending_at, f, trackers, start, start_step)
        hooks.end()
        return history

    def _run_logs(self, run: bool, files: bool) -> tuple:
        """The run's signal flag, trackers and metrics.jsonl (null contexts where there is no run directory, or
        on a rank that does not write)."""
        if files:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            if self.step == 0:
                self.fresh_run()
        stop = StopFlag(announce=files) if run else contextlib.nullcontext()
        # a resumed run drops the tracker points after its checkpoint's step and continues the same wandb run
        trackers = Trackers(self.cfg, self.run_dir, start_step=self.step, wandb_run_id=self.wandb_run_id) \
            if files else contextlib.nullcontext()
        self.wandb_run_id = getattr(trackers, "wandb_run_id", None) or self.wandb_run_id
        # a resumed run appends after the lines its checkpoint already covers
        out = open(self.run_dir / "metrics.jsonl", "a" if self.step else "w") if files else contextlib.nullcontext()
        return stop, trackers, out

    def _unevaluated_last_row(self, final_eval: bool) -> tuple[dict | None, int]:
        """A run resumed at its last step whose final eval never reached metrics.jsonl (killed during it, or its
        row rebuilt from the checkpoint): that row and its offset, so the final eval runs now as it would have;
        else (None, 0). Decided over every rank (the eval is collective)."""
        if not (final_eval and self.run_dir is not None and self.step and self.step == self.max_steps):
            return None, 0
        row, at = last_row(self.run_dir / "metrics.jsonl") if self.writes else (None, 0)
        missing = row is not None and row.get("step") == self.step and not any(k.startswith("eval/") for k in row)
        if self._sum(float(missing))[0] == 0:
            return None, 0
        return (row if self.writes else {}), at

    def _fold_final_eval(self, row: dict, at: int, f, trackers, start: float, start_step: int) -> None:
        """The held-out eval after the last step, kept in `self.final_eval` and folded into that step's
        `row`, which starts at offset `at` of metrics.jsonl (`f`)."""
        self.final_eval = self.run_eval(final=True)
        evals = self.eval_row(self.final_eval)
        row.update(evals)
        self.hooks.evaluated(self.step, evals)
        if self.writes:   # the last step's row again, now with the eval (trackers: the eval alone)
            f.seek(at)
            f.truncate()
            f.write(json.dumps(row) + "\n")
            f.flush()
            trackers.log(evals, self.step)
        self.show_progress(row, start, start_step, force=True)

    # ------------------------------------------------------------ checkpoints
    def extra_state(self) -> dict:
        """What a checkpoint keeps of this trainer besides its job, step and wandb run (e.g. the data position)."""
        return {}

    def restore_extra(self, state: dict, ckpt: Path) -> None:
        """Put back what `extra_state` kept (and any files of this trainer in the checkpoint)."""

    def rng_state(self) -> dict:
        """Random states beyond torch's (and CUDA's) that a checkpoint keeps."""
        return {}

    def restore_rng(self, rng: dict) -> None:
        pass

    def full_states(self) -> dict | None:
        """Sharded trainers: the full model/optimizer/reference states (gathered on every rank)."""
        return None

    def checkpoint_extra(self):
        """A callable writing extra files into the checkpoint directory (e.g. the critic's), or None."""
        return None

    @property
    def ref_model(self):
        """The frozen reference saved with the checkpoints (None: none, or the policy with LoRA off)."""
        return self.ref

    def load_state(self, ckpt: str | Path, weights: bool) -> dict:
        """Weights (unless `weights` is False), reference, optimizer and master weights from a checkpoint;
        returns the rest of its training state."""
        state = load_training_state(ckpt, self.model if weights else None, self.ref_model)
        self.opt.load_state_dict(state["optimizer"])
        if self.master and state.get("master") is not None:
            self.master.load(state["master"])
        return state

    def save(self) -> Path | None:
        """Write a checkpoint (the writing process; sharded, every rank first sends its shards to it)."""
        full = self.full_states()
        if not self.writes:
            return None
        rng = {"torch": torch.get_rng_state(), **self.rng_state()}
        if torch.cuda.is_available():
            rng["cuda"] = torch.cuda.get_rng_state_all()
        path = save_checkpoint(self.run_dir / "checkpoints", self.step, self.model, tokenizer=self.tok,
                               optimizer=self.opt, scheduler=self.sched, rng=rng, ref_model=self.ref_model,
                               full_states=full, master_weights=self.master.master if self.master else None,
                               extra=self.checkpoint_extra(),
                               trainer_state={"job": self.job, **self.extra_state(),
                                              **({"wandb_run_id": self.wandb_run_id} if self.wandb_run_id else {}),
                                              **({"logs": self.step_logs} if self.step_logs else {})})
        prune_checkpoints(self.run_dir / "checkpoints", self.cfg.train.keep_checkpoints)
        return path

    def restore(self, ckpt: str | Path, weights: bool = True) -> None:
        """Continue exactly from a checkpoint of this trainer: weights (unless the model was just loaded
        from it), reference, optimizer, scheduler, RNG states, data position, step and wandb run id;
        metrics.jsonl and samples.jsonl are cut back to that step, and that step's lines, when a crash tore or
        lost them, are written again from the checkpoint's copy (TensorBoard's points after it are dropped when
        training starts again)."""
        state = self.load_state(ckpt, weights)
        self.sched.load_state_dict(state["scheduler"])
        torch.set_rng_state(state["rng"]["torch"])
        self.restore_rng(state["rng"])
        if "cuda" in state["rng"] and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["rng"]["cuda"])
        tr = state["trainer"]
        self.step = tr["step"]
        self.wandb_run_id = tr.get("wandb_run_id")
        self.restore_extra(tr, Path(ckpt))
        self.step_logs = tr.get("logs") or {}
        # its lines come back only into the run it was saved in (a checkpoint started from in another directory
        # begins that run's logs after its step)
        own = Path(ckpt).resolve().parent.parent == Path(self.run_dir).resolve() if self.run_dir else False
        if self.writes:   # the writing process owns the files
            rewind_logs(self.run_dir, self.step, continues=self.step < self.max_steps,
                        eval_every=self.cfg.train.eval_every, carried=self.step_logs if own else {},
                        **({"warn": self.console.warn} if self.console is not None else {}))
