"""Rollouts sampled in the trainer's process by a vLLM engine, given the policy's weights (LoRA merged in)
once per optimizer step, right before its first sampling call."""

from __future__ import annotations

import time

from ..config import Config
from ..distributed import World
from ..monitor.console import Console, StepProgress
from .builtin_source import BuiltinSource
from .generation import Generation
from .prompt_feed import PromptFeed
from .source import Taken
from .vllm_engine import VLLMEngine


def vllm_options(cfg: Config) -> dict:
    """VLLMEngine's keyword arguments besides the model's config (here, or in a rollout worker)."""
    v, r, limit = cfg.vllm, cfg.rollout, cfg.data.max_prompt_length
    return dict(dtype=cfg.model.dtype,
                max_model_len=v.max_model_len or (r.max_new_tokens + limit if limit else None),
                gpu_memory_utilization=v.gpu_memory_utilization, kv_cache_gb=v.kv_cache_gb,
                enforce_eager=v.enforce_eager, prefix_caching=v.prefix_caching, seed=cfg.train.seed,
                trust_remote_code=cfg.model.trust_remote_code)


class VLLMSource(BuiltinSource):
    def __init__(self, cfg: Config, model, feed: PromptFeed, world: World, progress: StepProgress, *, tools=None,
                 console: Console | None = None, full_weights=None) -> None:
        super().__init__(cfg, model, feed, world, progress, full_weights=full_weights)   # (no tools: validated)
        self.engine = VLLMEngine(model.causal_lm().config, **vllm_options(cfg))
        self.for_eval = cfg.vllm.eval
        self.version = 0
        self.sync_s = 0.0   # this step's seconds giving the engine the policy's weights

    def _sync(self, version: int) -> float:
        """The engine gets the policy's weights of `version`, unless it has them. Returns the seconds it took."""
        if self.engine.weights_version == version:
            return 0.0
        t0 = time.perf_counter()
        self.engine.load_weights(self.model.merged_weights().items(), version)
        return time.perf_counter() - t0

    def take(self, step: int) -> Taken:
        self.version, self.sync_s = step, 0.0
        taken = super().take(step)
        taken.metrics["time/weight_sync"] = self.sync_s   # (inside time/generate)
        return taken

    def sample(self, prompts: list[list[int]], *, tools=None, on_tokens=None, **kw) -> Generation:
        """(vLLM runs no tools or environments: config validation refuses them with rollout.source=vllm)"""
        self.sync_s += self._sync(self.version)
        return self.engine.generate(prompts, **kw)

    def engine_for_eval(self, model, version: int) -> VLLMEngine | None:
        if not self.for_eval:
            return None
        self._sync(version)   # (not counted in a step's time/weight_sync)
        return self.engine

    def close(self) -> None:
        """Shut the engine down (its threads, its process group, its memory)."""
        if self.engine is not None:
            self.engine.close()
            self.engine = None
