"""The rollout source a run samples from, chosen once from the config: the trainer never asks which."""

from __future__ import annotations

import torch

from ..config import Config
from ..distributed import World
from ..monitor.console import Console, StepProgress
from .builtin_source import BuiltinSource
from .prompt_feed import PromptFeed
from .source import RolloutSource
from .vllm_engine import check_vllm_installed
from .vllm_source import VLLMSource
from .worker_source import WorkerSource


def make_source(cfg: Config, model, feed: PromptFeed, world: World, progress: StepProgress, *, tools=None,
                console: Console | None = None, full_weights=None) -> RolloutSource:
    """train.async_steps / rollout_workers: worker processes (which hold the vLLM engine themselves with
    rollout.engine=vllm); else rollout.engine: vLLM in this process, or the built-in engine."""
    device = next(model.parameters()).device
    if cfg.train.worker_count:
        if cfg.rollout.engine == "vllm":
            check_vllm_installed()   # here, in one line: a worker without vLLM would abort in its own process
        return WorkerSource(model, feed, world, progress, cfg, torch.device(device), console)
    if cfg.rollout.engine == "vllm":
        return VLLMSource(model, feed, world, progress, cfg, full_weights)
    return BuiltinSource(model, feed, world, progress, tools, full_weights)
