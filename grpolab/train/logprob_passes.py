"""How this run computes its completions' log-probs: in micro-batches of optim.micro_batch_size rows, at
the rollout's temperature, chunked over the vocabulary, a group's prompt shared or not."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import distributed as dist
from ..models.logprobs import completion_logprobs
from ..rollout.generation import Generation


@dataclass(frozen=True)
class LogProbPasses:
    temperature: float
    chunk: int | None          # optim.logprob_chunk; None: chosen per batch by its logits' size
    micro_batch_size: int      # 0: the whole batch at once
    share_group: int           # Plan.share_group
    sharded: bool              # Plan.sharded: every forward is a collective

    def micro_batches(self, n: int) -> tuple[list[slice], int]:
        """Row slices of at most micro_batch_size rows, and how many stand-in passes to add.

        Sharded, every forward and backward is a collective, so every rank must run as many; a rank
        with fewer rows (dynamic sampling) adds stand-ins: its first row again, with no weight."""
        mb = self.micro_batch_size or n
        out = [slice(i, min(n, i + mb)) for i in range(0, n, mb)]
        extra = int(dist.gather_rows(torch.tensor([len(out)])).max()) - len(out) if self.sharded else 0
        return out, extra

    def __call__(self, model, g: Generation, sl: slice, **kw):
        return completion_logprobs(model, g.prompt_ids[sl], g.prompt_mask[sl], g.completion_ids[sl],
                                   g.completion_mask[sl], self.temperature, chunk=self.chunk,
                                   context_mask=g.context_mask[sl], group=self.share_group, **kw)

    def frozen(self, model, g: Generation) -> torch.Tensor:
        """Log-probs of the sampled tokens without autograd bookkeeping (inference mode is cheaper than
        no_grad, but FSDP's gathered weights must not become inference tensors: no_grad when sharded)."""
        with torch.no_grad() if self.sharded else torch.inference_mode():
            slices, extra = self.micro_batches(g.completion_ids.size(0))
            lp = torch.cat([self(model, g, s) for s in slices])
            for _ in range(extra):
                self(model, g, slice(0, 1))
        return lp.clone()   # a normal tensor again, usable inside the loss
