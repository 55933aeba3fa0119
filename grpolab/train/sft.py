"""Supervised warm start: next-token cross-entropy on solved problems, loss on the answer only.

The demo keeps this deliberately short so the model is right some of the time and RL has
room to help (a fully trained model leaves GRPO nothing to do).
"""

from __future__ import annotations

import random
import time
from typing import Callable
import torch
import torch.nn.functional as F

from ..config import SFTConfig
from ..utils.padding import pad_sequences
from .schedule import lr_factor


def sft_batch(tokenizer, rows: list[dict]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ids, key_valid, loss_mask), right-padded. loss_mask marks the answer tokens to predict."""
    seqs, starts = [], []
    for r in rows:
        p = tokenizer.render_prompt(r["prompt"])
        seqs.append(p + tokenizer.render_completion(r["answer"]))
        starts.append(len(p))
    ids, valid = pad_sequences(seqs, tokenizer.pad_id, "right")
    loss_mask = valid & (torch.arange(ids.size(1))[None] >= torch.tensor(starts)[:, None])
    return ids, valid, loss_mask


def sft_lr_factor(step: int, warmup: int, steps: int) -> float:
    """The warm start's lr multiplier at step `step` (0-based): linear warmup times a linear decay
    that starts at step 0 and reaches 0 at `steps`."""
    return lr_factor(step, warmup, steps, "linear", decay_start=0)


def sft_loss(model, ids: torch.Tensor, valid: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    logits = model(ids[:, :-1], key_valid=valid[:, :-1])
    target_mask = loss_mask[:, 1:]
    ce = F.cross_entropy(logits.flatten(0, 1).float(), ids[:, 1:].flatten(), reduction="none")
    return (ce * target_mask.flatten()).sum() / target_mask.sum().clamp(min=1)


def train_sft(model, tokenizer, rows: list[dict], cfg: SFTConfig, seed: int = 0, log=None,
              batch_hook: Callable[[list[dict], int], list[dict]] | None = None) -> list[float]:
    """Train in place on `rows` (cycled, reshuffled each epoch). Returns the per-step losses.

    `batch_hook(batch, step)` may rewrite each batch's rows before tokenization."""
    rng = random.Random(seed)
    order: list[int] = []
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95),
                            weight_decay=cfg.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: sft_lr_factor(s, cfg.warmup_steps, cfg.steps))
    model.train()
    losses = []
    t0 = time.time()
    for step in range(cfg.steps):
        if len(order) < cfg.batch_size:
            perm = list(range(len(rows)))
            rng.shuffle(perm)
            order += perm
        batch = [rows[i] for i in order[:cfg.batch_size]]
        del order[:cfg.batch_size]
        if batch_hook is not None:
            batch = batch_hook(batch, step)
        loss = sft_loss(model, *sft_batch(tokenizer, batch))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
        opt.step()
        sched.step()
        losses.append(loss.item())
        if log and (step % 50 == 0 or step == cfg.steps - 1):
            log(f"sft step {step + 1}/{cfg.steps}  loss {loss.item():.4f}  ({time.time() - t0:.0f}s)")
    model.eval()
    return losses
