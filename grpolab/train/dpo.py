"""Direct preference optimisation: the policy learns to prefer the chosen completion over the
rejected one, relative to a frozen reference (the starting policy; under LoRA, the policy with
its adapters off: no second copy).

One step: `dpo.batch_size` pairs -> chosen and rejected sides tokenized (prompt + completion,
loss mask on the completion) -> one forward over both -> summed completion log-probs of policy
and reference -> dpo_loss (algorithms/losses.py) -> mean over the batch's pairs -> AdamW.
Metrics use TRL's names: rewards/chosen, rewards/rejected, rewards/accuracies, rewards/margins,
logps/chosen, logps/rejected.
"""

from __future__ import annotations

import torch

from ..algorithms.losses import dpo_loss
from ..data.preference import side_row
from ..data.supervised import collate, encode, fit_length
from ..models.logprobs import summed_logprobs
from ..models.reference import frozen_reference, reference
from .offline_trainer import OfflineTrainer
from .sft import model_context, task_eval


class DPOTrainer(OfflineTrainer):
    job = "dpo"

    def __init__(self, cfg, model, tokenizer, pairs: list[dict], *, test_rows: list[dict] | None = None,
                 run_dir=None, console=None) -> None:
        super().__init__(cfg, cfg.dpo, model, tokenizer, pairs, run_dir=run_dir, console=console)
        self.ref = frozen_reference(model)
        self.max_length = model_context(model) or 10 ** 9
        self.chunk = cfg.optim.logprob_chunk   # None: chosen per batch by its logits' size
        self.test_rows = (test_rows or [])[:cfg.eval.num_problems]

    def units(self, rows: list[dict]) -> list:
        """(chosen, rejected) examples per pair, each cut to the model's context."""
        out = []
        for p in rows:
            sides = fit_length([encode(self.tok, side_row(p, s)) for s in ("chosen", "rejected")], self.max_length,
                               "truncate")[0]
            if all(e is not None for e in sides):
                out.append(tuple(sides))
        return out

    def _seq_logps(self, model, b: dict) -> torch.Tensor:
        seq = summed_logprobs(model, b, chunk=self.chunk)
        if self.cfg.dpo.loss_type == "ipo":   # IPO on per-token averages (as TRL)
            seq = seq / b["loss"][:, 1:].sum(-1).clamp(min=1)
        return seq

    def micro_loss(self, units: list, total: float) -> tuple[torch.Tensor, dict]:
        d = self.cfg.dpo
        n = len(units)
        b = {k: v.to(self.device) for k, v in collate([c for c, _ in units] + [r for _, r in units],
                                                      self.tok.pad_id).items()}
        seq = self._seq_logps(self.model, b)
        with torch.no_grad(), reference(self.model, self.ref) as r:
            ref = self._seq_logps(r, b)
        losses, cr, rr = dpo_loss(seq[:n], seq[n:], ref[:n], ref[n:], beta=d.beta, loss_type=d.loss_type,
                                  label_smoothing=d.label_smoothing)
        sums = {"rewards/chosen": float(cr.sum()), "rewards/rejected": float(rr.sum()),
                "rewards/accuracies": float((cr > rr).float().sum()), "rewards/margins": float((cr - rr).sum()),
                "logps/chosen": float(seq[:n].detach().sum()), "logps/rejected": float(seq[n:].detach().sum())}
        return losses.sum() / max(total, 1.0), sums

    def progress_parts(self, m: dict) -> list[str]:
        return [f"loss {m['loss']:.4f}", f"acc {m['rewards/accuracies']:.2f}", f"margin {m['rewards/margins']:.3f}",
                *[f"{k.removeprefix('eval/')} {m[k]:.3f}" for k in ("eval/greedy_accuracy",) if k in m]]

    def heldout(self) -> dict:
        return task_eval(self.cfg, self.model, self.tok, self.test_rows) if self.test_rows else {}
