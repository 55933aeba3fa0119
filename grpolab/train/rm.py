"""Reward-model training (`grpolab rm`): learn a scalar score that ranks each pair's chosen
completion above its rejected one (Bradley-Terry).

One step: `rm.batch_size` pairs -> both sides tokenized as the `rm:` reward will score them
(models/reward_head.py) -> one forward over chosen and rejected -> bradley_terry_loss
(algorithms/losses.py) with the row's `margin` (or rm.margin) and rm.center_rewards_coefficient
-> mean over the batch's pairs -> AdamW. The loop, checkpoints and resume are train/base.py's.
Metrics (TRL's names): accuracy (share of pairs ranked right; a tie is not), margin (mean
r_chosen - r_rejected), rewards/chosen, rewards/rejected; held out: eval/accuracy, eval/margin, eval/loss.
"""

from __future__ import annotations

import torch

from ..algorithms.losses import bradley_terry_loss
from ..rewards.calling import completion_text
from .offline_trainer import OfflineTrainer

PairIds = tuple[list[int], list[int], float]   # chosen ids, rejected ids, margin


class RewardTrainer(OfflineTrainer):
    job = "rm"
    summary_keys = ("accuracy", "margin", "loss")

    def __init__(self, cfg, rm, pairs: list[dict], *, test_pairs: list[dict] | None = None,
                 run_dir=None, console=None) -> None:
        r = cfg.rm
        self._encoded = {id(p): self.encode(rm, p, r.margin) for p in pairs}
        super().__init__(cfg, r, rm, rm.tok, pairs, run_dir=run_dir, console=console)
        self.test_units = [self.encode(rm, p, r.margin) for p in (test_pairs or [])]

    @staticmethod
    def encode(rm, pair: dict, margin: float) -> PairIds:
        texts = [completion_text(pair[side]) for side in ("chosen", "rejected")]
        return rm.ids(pair["prompt"], texts[0]), rm.ids(pair["prompt"], texts[1]), float(pair.get("margin", margin))

    def units(self, rows: list[dict]) -> list[PairIds]:
        return [self._encoded[id(p)] for p in rows]

    def _scores(self, units: list[PairIds]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        n = len(units)
        s = self.model([c for c, _, _ in units] + [r for _, r, _ in units])
        margin = torch.tensor([m for _, _, m in units], device=s.device)
        return s[:n], s[n:], margin

    def micro_loss(self, units: list[PairIds], total: float) -> tuple[torch.Tensor, dict]:
        chosen, rejected, margin = self._scores(units)
        losses = bradley_terry_loss(chosen, rejected, margin, self.cfg.rm.center_rewards_coefficient)
        c, r = chosen.detach(), rejected.detach()
        sums = {"accuracy": float((c > r).sum()), "margin": float((c - r).sum()),
                "rewards/chosen": float(c.sum()), "rewards/rejected": float(r.sum())}
        return losses.sum() / max(total, 1.0), sums

    def heldout(self) -> dict:
        if not self.test_units:
            return {}
        sums = {"loss": 0.0, "accuracy": 0.0, "margin": 0.0}
        bs = self.s.micro_batch_size or self.s.batch_size
        with torch.no_grad():
            for i in range(0, len(self.test_units), bs):
                loss, part = self.micro_loss(self.test_units[i:i + bs], 1.0)   # total 1: the summed loss
                sums["loss"] += float(loss)
                sums["accuracy"] += part["accuracy"]
                sums["margin"] += part["margin"]
        return {f"eval/{k}": v / len(self.test_units) for k, v in sums.items()}

    def progress_parts(self, m: dict) -> list[str]:
        held = [f"held-out acc {m['eval/accuracy']:.3f}"] if "eval/accuracy" in m else []
        return [f"loss {m['loss']:.4f}", f"acc {m['accuracy']:.2f}", f"margin {m['margin']:.3f}", *held]
