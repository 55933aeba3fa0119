"""Reward models: spec 'rm:<local dir or hub id>' scores prompt+completion with a reward model.

Three kinds load (models/reward_head.py): a `grpolab rm` checkpoint of the built-in GPT (a score head
on its last hidden state), a Hugging Face AutoModelForSequenceClassification (logits[:, 0] on the
joined text; `grpolab rm` writes one for HF backbones), or a `grpolab dpo` checkpoint (its implicit
reward beta * log pi/pi_ref). Chat-message prompts are rendered with the
RM tokenizer's chat template (completion as the assistant turn) when it has one; otherwise texts
are concatenated.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path
from typing import Callable

import torch

from ..errors import RewardError
from ..models.reward_head import (
    BUILTIN_RM,
    _architectures,
    checkpoint_kind,
    is_dpo_checkpoint,
    load_builtin_rm,
    load_hf_rm,
    load_implicit_rm,
)
from .calling import completion_texts

PREFIX = "rm:"


def _source_key(source: str) -> str:
    """Absolute path for a local directory (so one model loads once whatever cwd named it), else the hub id."""
    p = Path(source).expanduser()
    return str(p.resolve()) if p.is_dir() else source


# a Hugging Face hub repo id: 'name' or 'namespace/name', letters, digits, '-', '_', '.' (no '--' or '..',
# not starting or ending with '-' or '.'), at most 96 characters
_HUB_PART = r"(?![-.])(?!.*(?:--|\.\.))[\w.-]{1,96}(?<![-.])"
_HUB_ID = re.compile(rf"(?:{_HUB_PART}/)?{_HUB_PART}", re.ASCII)


def _meant_local(source: str) -> bool:
    """True when `source` can only be a local path: it starts with ./ ../ / ~, its first component is a
    directory here (runs/...), or it is not a valid hub repo id."""
    return (source.startswith((".", "/", "~")) or Path(re.split(r"[/\\]", source)[0]).is_dir()
            or not _HUB_ID.fullmatch(source))


@functools.lru_cache(maxsize=None)
def load_reward_model(source: str, device: str | None = None):
    """A reward model (models/reward_head.py) in eval mode on `device`, loaded once per (source, device):
    a `grpolab rm` checkpoint of the built-in GPT, a `grpolab dpo` checkpoint (its implicit reward), or
    a Hugging Face sequence classifier."""

    spec = PREFIX + source
    if not source.strip():
        raise RewardError("reward 'rm:' names no model; give rm:<checkpoint dir or hub id> (in a pipeline, 'rm:' alone "
                          "is the last rm stage's reward model)")
    if _meant_local(source) and not Path(source).expanduser().is_dir():   # said at once: no hub retries
        what = " (it is a file)" if Path(source).expanduser().exists() else ""
        raise RewardError(f"reward {spec!r}: directory {source!r} not found{what}; give a local model directory "
                          f"(relative to {Path.cwd()}) or a hub id")
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    kind = checkpoint_kind(source)
    if kind == BUILTIN_RM:
        return load_builtin_rm(source, device)
    if is_dpo_checkpoint(source):   # a DPO policy is a reward model too: its implicit reward
        return load_implicit_rm(source, device)
    arch = _architectures(source) if kind == "hf" else []
    if kind not in (None, "hf") or (arch and not any("ForSequenceClassification" in a for a in arch)):
        what = kind if kind not in (None, "hf") else ", ".join(arch)
        raise RewardError(f"reward {spec!r}: {source!r} is a policy checkpoint ({what}), not a reward model; "
                          f"train one with `grpolab rm` (rm.pairs) and give its checkpoints/step_N")
    try:
        rm = load_hf_rm(source, device=device)
    except Exception as e:  # noqa: BLE001 - one readable line instead of a loader traceback
        msg = (str(e).strip().splitlines() or [""])[0]
        raise RewardError(f"reward {spec!r}: cannot load a sequence-classification model and tokenizer from "
                          f"{source!r} ({type(e).__name__}: {msg}); give a directory with config.json, weights and "
                          f"tokenizer files, or a hub id already in the local cache") from e
    return rm.eval()


def score_pairs(rm, prompts: list, completions: list[str], batch_size: int = 16) -> list[float]:
    """The reward model's score of each (prompt, completion), in padded batches, without autograd."""
    ids = [rm.ids(p, c) for p, c in zip(prompts, completions)]
    scores: list[float] = []
    with torch.no_grad():
        for i in range(0, len(ids), batch_size):
            scores.extend(rm(ids[i:i + batch_size]).cpu().tolist())
    return scores


@functools.lru_cache(maxsize=None)
def _reward_fn(key: str, batch_size: int, device: str | None) -> Callable[..., list[float]]:
    rm = load_reward_model(key, device)

    def rm_reward(prompts, completions, **_) -> list[float]:
        completions = completion_texts(completions)
        prompts = prompts if prompts is not None else [None] * len(completions)
        return score_pairs(rm, prompts, completions, batch_size)

    rm_reward.__name__ = "rm_" + Path(key.rstrip("/\\")).name
    # the Hugging Face model and tokenizer themselves where there are (the built-in: the reward model)
    rm_reward.model, rm_reward.tokenizer = getattr(rm, "hf", rm), rm.tok
    return rm_reward


def reward_model(source: str, batch_size: int = 16, device: str | None = None) -> Callable[..., list[float]]:
    """Reward function scoring prompt+completion with the model at `source` (cached per process)."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if not source.strip():
        load_reward_model(source)   # its one-line error
    return _reward_fn(_source_key(source), batch_size, device)
