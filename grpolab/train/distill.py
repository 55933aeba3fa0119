"""Knowledge distillation from a teacher into the student (the policy).

logits mode: on given completions (prompt + completion rows, as SFT), the student matches the
teacher's next-token distribution at every completion position: forward KL(teacher || student)
(classic; covers the teacher's mass) or reverse KL(student || teacher) (mode-seeking).
on_policy mode: each step the student samples completions for `distill.batch_size` prompts and
the loss is the per-position reverse KL to the teacher on the student's own tokens (GKD /
on-policy distillation: the student is corrected where it actually goes).
Both: summed over completion positions / the batch's completion tokens, so micro-batching
leaves the gradient as it is; the KLs are algorithms/losses.py's distill_kl.
"""

from __future__ import annotations

import torch

from ..algorithms.losses import distill_kl
from ..data.supervised import Example, collate, encode, fit_length
from ..rollout.engine import generate
from ..rollout.keys import completion_keys
from .offline_trainer import OfflineTrainer
from .sft import model_context, task_eval

DISTILL_SALT = 0x64737469   # 'dsti': on-policy samples never share keys with RL rollouts of the same seed


class DistillTrainer(OfflineTrainer):
    job = "distill"

    def __init__(self, cfg, model, tokenizer, teacher, rows: list[dict], *, test_rows: list[dict] | None = None,
                 run_dir=None, console=None) -> None:
        super().__init__(cfg, cfg.distill, model, tokenizer, rows, run_dir=run_dir, console=console)
        self.teacher = teacher.eval().requires_grad_(False)
        self.max_length = min(x for x in (model_context(model), model_context(teacher), 10 ** 9) if x)
        self.test_rows = (test_rows or [])[:cfg.eval.num_problems]
        self.on_policy = cfg.distill.mode == "on_policy"
        self._first = 0

    def next_rows(self) -> list:
        self._first = self.stream.drawn   # keys the step's samples (on_policy): the same after a resume
        return super().next_rows()

    def units(self, rows: list[dict]) -> list[Example]:
        if not self.on_policy:   # rows: SFT rows
            return [e for e in fit_length([encode(self.tok, r) for r in rows], self.max_length, "truncate")[0] if e]
        r = self.cfg.rollout   # rows: task rows; the student samples one completion per prompt
        prompts = [self.tok.render_prompt(x["prompt"]) for x in rows]
        draws = torch.arange(self._first, self._first + len(rows))
        keys = completion_keys(self.cfg.train.seed ^ DISTILL_SALT, draws, torch.zeros_like(draws))
        self.model.eval()
        budget = min(r.max_new_tokens, self.max_length - max(len(p) for p in prompts))
        gen = generate(self.model, prompts, num_generations=1, max_new_tokens=max(1, budget),
                       temperature=r.temperature, top_k=r.top_k, top_p=r.top_p, stop_ids=self.tok.stop_ids,
                       pad_id=self.tok.pad_id, keys=keys)
        out = []
        for p, ids, m in zip(prompts, gen.completion_ids, gen.completion_mask):
            c = ids[m].tolist()
            out.append(Example(p + c, [False] * len(p) + [True] * len(c)))
        return out

    def weight(self, units: list[Example]) -> float:
        return float(sum(sum(e.loss[1:]) for e in units))

    def micro_loss(self, units: list[Example], total: float) -> tuple[torch.Tensor, dict]:
        d = self.cfg.distill
        b = {k: v.to(self.device) for k, v in collate(units, self.tok.pad_id).items()}
        ids, valid = b["ids"][:, :-1], b["valid"][:, :-1]
        mask = b["loss"][:, 1:]
        student = self.model(ids, key_valid=valid)
        with torch.no_grad():
            teacher = self.teacher(ids.to(next(self.teacher.parameters()).device), key_valid=valid)
        direction = "reverse" if self.on_policy else d.kl
        kl = distill_kl(student, teacher.to(student.device), direction=direction, temperature=d.temperature)
        loss = (kl * mask).sum() / max(total, 1.0)
        return loss, {"kl": float((kl.detach() * mask).sum()), "tokens": float(mask.sum())}

    def step_metrics(self, sums: dict, total: float) -> dict:
        return {"kl": sums.get("kl", 0.0) / max(total, 1.0), "tokens": sums.get("tokens", 0.0)}

    def heldout(self) -> dict:
        return task_eval(self.cfg, self.model, self.tok, self.test_rows) if self.test_rows else {}
