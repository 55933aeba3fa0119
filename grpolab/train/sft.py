"""Supervised fine-tuning: next-token cross-entropy on the completion (assistant) tokens only.

One step: `sft.batch_size` rows -> token ids and loss masks (data/supervised.py; chat-template
aware) -> optionally packed (sft.packing) -> micro-batches -> summed cross-entropy / the batch's
loss tokens (so micro-batching leaves the gradient as it is) -> AdamW. The loop, checkpoints and
resume are train/base.py's. The demo's warm start is this trainer without a run directory.
"""

from __future__ import annotations

import torch

from ..data.supervised import Example, collate, encode, fit_length, pack, task_sft_rows
from ..data.tasks import arithmetic, pyfunc
from ..errors import DataError
from ..models.logprobs import token_logprobs
from ..monitor.console import eta_seconds, progress_line
from ..rewards.runtime import RewardRuntime
from ..rollout.tool_decode import build_tool_use
from .evaluate import evaluate
from .offline_trainer import OfflineTrainer, total_steps
from .schedule import lr_factor
from .warm_start_cache import ENV, WarmStartCache


def model_context(model) -> int | None:
    """The longest sequence the model takes (block_size, or max_position_embeddings)."""
    c = model.config
    return getattr(c, "block_size", None) or getattr(c, "max_position_embeddings", None)


def sft_batch(tokenizer, rows: list[dict]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ids, key_valid, loss_mask) of task rows (prompt + answer), right-padded; loss_mask marks the
    answer tokens (and the stop token) to predict."""
    b = collate([encode(tokenizer, {"prompt": r["prompt"], "completion": r["answer"]}) for r in rows], tokenizer.pad_id)
    return b["ids"], b["valid"], b["loss"]


def sft_lr_factor(step: int, warmup: int, steps: int) -> float:
    """The warm start's lr multiplier at step `step` (0-based): linear warmup times a linear decay
    that starts at step 0 and reaches 0 at `steps`."""
    return lr_factor(step, warmup, steps, "linear", decay_start=0)


def masked_token_loss(logp: torch.Tensor, loss_mask: torch.Tensor, total: float) -> torch.Tensor:
    """Cross-entropy summed over the tokens to predict, divided by `total` (the whole batch's count of
    them): logp (B, T-1) are the log-probs of ids[:, 1:], loss_mask (B, T) marks the tokens to predict."""
    return (-logp * loss_mask[:, 1:]).sum() / total


class SFTTrainer(OfflineTrainer):
    """`rows`: SFT rows (data/supervised.py's formats). `test_rows`: the task's held-out rows, for
    greedy accuracy and pass@k; `heldout_rows`: SFT rows for the held-out loss."""

    job = "sft"

    def __init__(self, cfg, model, tokenizer, rows: list[dict], *, test_rows: list[dict] | None = None,
                 heldout_rows: list[dict] | None = None, run_dir=None, console=None, batch_hook=None) -> None:
        s = cfg.sft
        context = model_context(model)
        self.max_length = min(x for x in (s.max_length, context) if x) if (s.max_length or context) else 10 ** 9
        fitted, truncated, dropped = fit_length([encode(tokenizer, r) for r in rows], self.max_length, s.on_long)
        if dropped == len(rows):
            raise DataError(f"sft: every row is longer than sft.max_length={self.max_length} tokens with no "
                            f"completion token inside it; raise sft.max_length")
        if (dropped or truncated) and console is not None:
            console.info(f"sft: {truncated} rows truncated and {dropped} dropped at {self.max_length} tokens "
                         f"(sft.max_length, sft.on_long={s.on_long})")
        rows = [r for r, e in zip(rows, fitted) if e is not None]
        examples = [e for e in fitted if e is not None]
        super().__init__(cfg, s, model, tokenizer, rows, run_dir=run_dir, console=console, batch_hook=batch_hook)
        # each row's example, encoded once (a row a batch hook rewrote is a new object: encoded when used)
        self._examples = {id(r): e for r, e in zip(self.rows, examples)}
        self.test_rows = (test_rows or [])[:cfg.eval.num_problems]
        self.heldout_rows = (heldout_rows or [])[:cfg.eval.num_problems]
        self.chunk = cfg.optim.logprob_chunk   # None: chosen per batch by its logits' size

    def units(self, rows: list) -> list[Example]:
        out = [self._examples.get(id(r)) or fit_length([encode(self.tok, r)], self.max_length, "truncate")[0][0]
               for r in rows]
        return [e for e in out if e is not None]

    def weight(self, units: list[Example]) -> float:
        return float(sum(sum(e.loss[1:]) for e in units))

    def micro_loss(self, units: list[Example], total: float) -> tuple[torch.Tensor, dict]:
        items = pack(units, self.max_length) if self.s.packing else units
        b = {k: v.to(self.device) for k, v in collate(items, self.tok.pad_id).items()}
        logp = token_logprobs(self.model, b["ids"], b["valid"], segments=b.get("segments"), chunk=self.chunk)
        loss = masked_token_loss(logp, b["loss"], max(total, 1.0))
        return loss, {"tokens": float(b["loss"][:, 1:].sum())}

    def step_metrics(self, sums: dict, total: float) -> dict:
        return {"tokens": sums.get("tokens", 0.0)}

    def heldout(self) -> dict:
        out = {}
        if self.heldout_rows:
            out["eval/loss"] = heldout_loss(self.model, self.tok, self.heldout_rows, self.max_length, self.chunk,
                                            self.cfg.eval.batch_size)
        if self.test_rows:
            out.update(task_eval(self.cfg, self.model, self.tok, self.test_rows))
        return out


@torch.no_grad()
def heldout_loss(model, tokenizer, rows: list[dict], max_length: int, chunk: int | None = 0,
                 batch_size: int = 64) -> float:
    """Mean cross-entropy per completion token of SFT rows (longer ones truncated)."""
    model.eval()
    examples = [e for e in fit_length([encode(tokenizer, r) for r in rows], max_length, "truncate")[0] if e]
    device = next(model.parameters()).device
    total, n = 0.0, 0.0
    for i in range(0, len(examples), batch_size):
        b = {k: v.to(device) for k, v in collate(examples[i:i + batch_size], tokenizer.pad_id).items()}
        logp = token_logprobs(model, b["ids"], b["valid"], chunk=chunk)
        total += float((-logp * b["loss"][:, 1:]).sum())
        n += float(b["loss"][:, 1:].sum())
    return total / max(n, 1.0)


def task_eval(cfg, model, tokenizer, rows: list[dict]) -> dict:
    """The task's held-out metrics (greedy accuracy, pass@k, maj@k) as eval/... keys."""
    e, runtime = cfg.eval, RewardRuntime.from_config(cfg.reward)
    res = evaluate(model, tokenizer, rows, k=e.k, temperature=e.temperature, max_new_tokens=cfg.rollout.max_new_tokens,
                   batch_size=e.batch_size, seed=cfg.train.seed, reward=e.reward, runtime=runtime,
                   tools=build_tool_use(cfg.rollout, tokenizer, cfg.model.name_or_path, runtime))
    res.pop("samples")
    return {f"eval/{k}": v for k, v in res.items()}


def warm_start_hook(cfg, n_rows: int):
    """The demos' warm-start recipe: correct answers, then for the last sft.bare_steps steps a seeded
    sft.bare_fraction of guesses: bare '#### N' answers (arithmetic) or a guessed constant (pyfunc).
    None when off or for other tasks."""
    s = cfg.sft
    mixers = {"arithmetic": arithmetic.warm_start_mixer, "pyfunc": pyfunc.warm_start_mixer}
    if cfg.data.task not in mixers or s.train_path or s.bare_fraction <= 0:
        return None
    steps = total_steps(s, n_rows)
    return mixers[cfg.data.task](s.bare_fraction, max(0, steps - s.bare_steps) if s.bare_steps else 0,
                                 cfg.train.seed, key="completion")


def train_sft(model, tokenizer, rows: list[dict], cfg, log=None, batch_hook=None) -> list[float]:
    """The demo's warm start: SFT on the task's rows (prompt + answer) in place, nothing written but
    the warm-start cache's entry (train/warm_start_cache.py: a later run with the same key loads the
    same bits instead). `cfg` is the whole Config (its sft section); returns the per-step losses."""

    class _Log:   # the warm start's progress goes to `log` (console.info): a line at the loop's interval, with ETA
        def progress(self, job, step, total, elapsed, parts, start_step=0):
            if log is not None:
                log(progress_line(f"warm start: {job}", step, total, eta_seconds(elapsed, step - start_step,
                                                                                   total - step), parts))

        def info(self, msg):
            if log is not None:
                log(msg)

        def warn(self, msg):
            if log is not None:
                log(f"warning: {msg}")
    sft_rows = task_sft_rows(rows)
    cache = WarmStartCache.open(cfg, model, sft_rows)
    if cache is not None and cache.load(model):
        if log is not None:
            log(f"warm start: reused {cache.path} (same sft settings, model, seed, rows, code and torch build: "
                f"the same weights a new warm start gives; {ENV}=0 recomputes it)")
        return cache.losses
    tr = SFTTrainer(cfg, model, tokenizer, sft_rows, console=_Log(), batch_hook=batch_hook)
    losses = [m["loss"] for m in tr.train()]
    if cache is not None:
        problem = cache.save(model, losses)
        if log is not None:
            log(f"warm start: not cached: {problem}" if problem else
                f"warm start: cached in {cache.path} (later runs with the same key reuse it; {ENV}=0 turns "
                f"the cache off)")
    return losses
