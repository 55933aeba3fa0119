"""The rollout source a run samples from, chosen once from the config: the trainer never asks which it has.
rollout.source names the source in the trainer's process; train.async_steps / rollout_workers hand sampling to
worker processes (which run rollout.source's vLLM themselves when asked).

A source is a RolloutSource (rollout/source.py) whose constructor takes
`(cfg, model, feed, world, progress, *, tools, console, full_weights)`; a new one is a file of its own and one
line in config/names.py's SOURCES (docs/architecture.md shows one)."""

from __future__ import annotations

from ..config import Config
from ..config.names import SOURCES, WORKERS, load
from ..distributed import World
from ..monitor.console import Console, StepProgress
from .prompt_feed import PromptFeed
from .source import RolloutSource
from .vllm_engine import check_vllm_installed


def source_name(cfg: Config) -> str:
    """The source `cfg` samples from: rollout workers when it asks for them, else rollout.source."""
    return WORKERS if cfg.train.worker_count else cfg.rollout.source


def make_source(cfg: Config, model, feed: PromptFeed, world: World, progress: StepProgress, *, tools=None,
                console: Console | None = None, full_weights=None) -> RolloutSource:
    source = load(SOURCES, source_name(cfg), "rollout.source")
    if cfg.rollout.source == "vllm":
        check_vllm_installed()   # here, in one line (a worker without vLLM would abort in its own process)
    return source(cfg, model, feed, world, progress, tools=tools, console=console, full_weights=full_weights)
