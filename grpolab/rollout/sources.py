"""The rollout sources by name, and the one a run samples from, chosen once from the config: the trainer
never asks which it has. rollout.engine names the source in the trainer's process; train.async_steps /
rollout_workers hand sampling to worker processes (which run rollout.engine's vLLM themselves when asked).

A source is a RolloutSource (rollout/source.py) whose constructor takes
`(cfg, model, feed, world, progress, *, tools, console, full_weights)`; a new one is a file of its own, one
line in SOURCES and its name in config/names.py's ROLLOUT_ENGINES (docs/architecture.md shows one)."""

from __future__ import annotations

from ..config import Config
from ..distributed import World
from ..errors import ConfigError
from ..monitor.console import Console, StepProgress
from .builtin_source import BuiltinSource
from .prompt_feed import PromptFeed
from .source import RolloutSource
from .vllm_engine import check_vllm_installed
from .vllm_source import VLLMSource
from .worker_source import WorkerSource

SOURCES: dict[str, type[RolloutSource]] = {
    "builtin": BuiltinSource,
    "vllm": VLLMSource,
    "workers": WorkerSource,
}


def source_name(cfg: Config) -> str:
    """The source `cfg` samples from: rollout workers when it asks for them, else rollout.engine."""
    return "workers" if cfg.train.worker_count else cfg.rollout.engine


def make_source(cfg: Config, model, feed: PromptFeed, world: World, progress: StepProgress, *, tools=None,
                console: Console | None = None, full_weights=None) -> RolloutSource:
    name = source_name(cfg)
    if name not in SOURCES:
        raise ConfigError(f"rollout.engine: {name!r} is not one of {', '.join(n for n in SOURCES if n != 'workers')}")
    if cfg.rollout.engine == "vllm":
        check_vllm_installed()   # here, in one line (a worker without vLLM would abort in its own process)
    return SOURCES[name](cfg, model, feed, world, progress, tools=tools, console=console, full_weights=full_weights)
