"""Where a step's rollout batch comes from: the one interface the trainer sees.

    publish(model, version)   the policy after `version` optimizer steps is the one to sample with next
    take(step)                the batch of step `step` + 1, this rank's share, with its group ids and the
                              weight version that sampled it, and the source's timings
    engine_for_eval(model, version)   the engine the held-out eval samples with (None: the built-in one)
    state() / save(path) / restore(state, ckpt, step)   what a checkpoint keeps of it
    close()

Three implementations, chosen once by rollout/sources.py: the built-in engine in this process
(builtin_source.py), a vLLM engine in this process (vllm_source.py), rollout worker processes sampling
k steps ahead (worker_source.py). Each draws its prompts through the same PromptFeed (prompt_feed.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ..errors import ConfigError, TrainingError
from .batch import RolloutBatch


@dataclass
class Taken:
    batch: RolloutBatch
    epoch: float                                           # the prompts' passes before this batch's prompts
    metrics: dict[str, float] = field(default_factory=dict)   # time/generate and the source's own (time/*, async/*)


def diverged(step: int) -> TrainingError:
    """The error for a policy whose next-token probabilities came out NaN/inf while sampling step `step` + 1."""
    return TrainingError(f"step {step + 1}: the policy's next-token probabilities are NaN/inf (the "
                         f"weights diverged); lower optim.lr, keep optim.max_grad_norm > 0, or resume "
                         f"from an earlier checkpoint")


def check_clock(saved: dict | None, k: int, ckpt: Path) -> None:
    """A checkpoint's batches in flight (`saved`: its "async", None without) were sampled on its
    train.async_steps clock: a resume keeps that clock."""
    if saved and saved["async_steps"] != k:
        raise ConfigError(f"train.async_steps: {ckpt} was written with train.async_steps={saved['async_steps']}; "
                          f"resume it with the same value (this run has {k})")


class RolloutSource:
    """The interface, with the defaults of a source that keeps nothing between steps."""
    saves_files = False   # save(path) writes files into a checkpoint

    def publish(self, model, version: int) -> None:
        pass

    def take(self, step: int) -> Taken:
        raise NotImplementedError

    def engine_for_eval(self, model, version: int):
        return None

    def state(self) -> dict:
        return {}

    def save(self, path: Path) -> None:
        pass

    def restore(self, state: dict, ckpt: Path, step: int) -> None:
        """A checkpoint whose batches were sampled ahead (train.async_steps > 0) resumes only on that clock."""
        check_clock(state.get("async"), 0, ckpt)

    def close(self) -> None:
        pass
