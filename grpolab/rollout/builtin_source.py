"""Rollouts sampled in the trainer's process by the built-in engine, on the policy's own weights."""

from __future__ import annotations

import time
from contextlib import nullcontext

from ..config import Config
from ..distributed import World
from ..errors import NonFiniteLogits
from ..monitor.console import Console, StepProgress
from .engine import sample
from .generation import Generation
from .prompt_feed import PromptFeed, Request, rank_share
from .source import RolloutSource, Taken, diverged


class BuiltinSource(RolloutSource):
    def __init__(self, cfg: Config, model, feed: PromptFeed, world: World, progress: StepProgress, *, tools=None,
                 console: Console | None = None, full_weights=None) -> None:
        self.cfg, self.model, self.feed, self.world, self.progress = cfg, model, feed, world, progress
        self.tools = tools
        # sharded policies: the whole weights gathered for the decode (sharding.full_weights)
        self.full_weights = full_weights or (lambda model: nullcontext())

    def take(self, step: int) -> Taken:
        t0 = time.perf_counter()
        req = self.feed.draw()
        share = rank_share(len(req.rows), self.world.rank, self.world.size)
        req = Request(req.rows[share], req.draws[share], req.epoch)
        self.model.eval()
        self.progress.start_phase("rollout", len(req.rows) * self.feed.G)
        # counts the tokens as they are sampled, for the progress line
        count = self._count_tokens if self.progress.on and self.tools is None else None
        # tools are the same for every row; an environment starts each row's episodes from its dataset row
        tools = None if self.tools is None else self.tools.bind([self.feed.rows[i] for i in req.rows])
        try:
            with self.full_weights(self.model):   # sharded: gathered once for the whole decode
                gens = [self.sample(c.pop("prompts"), tools=tools, on_tokens=count if i == 0 else None, **c)
                        for i, c in enumerate(self.feed.calls(req))]
        except NonFiniteLogits:
            raise diverged(step) from None
        batch = self.feed.batch(req.rows, gens, step)
        return Taken(batch, req.epoch, {"time/generate": time.perf_counter() - t0})

    def sample(self, prompts: list[list[int]], *, tools=None, **kw) -> Generation:
        """One engine call (vllm_source.VLLMSource samples with vLLM instead); `tools`: bound to the rows."""
        return sample(self.model, prompts, tools=tools, max_slots=self.cfg.rollout.max_slots or None, **kw)

    def _count_tokens(self, n: int) -> None:
        self.progress.add(tokens=n)
