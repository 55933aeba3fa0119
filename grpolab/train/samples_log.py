"""samples.jsonl: a step's first completions with their prompt, rewards (per function), advantage, tool calls
and what the reward functions logged for them."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path

from ..rollout.batch import RolloutBatch


def row_advantage(b: RolloutBatch, i: int) -> float:
    """A row's advantage: the sequence's, or (token-level estimators) the mean over its tokens."""
    adv = b.advantages[i]
    if adv.dim() == 0:
        return float(adv)
    m = b.gen.completion_mask[i].to(adv.device)
    return float(adv[m].mean()) if m.any() else 0.0


def sample_records(b: RolloutBatch, step: int, n: int, name: Callable[[str], str]) -> list[dict]:
    """The batch's first `n` rows as samples.jsonl records."""
    names = {spec: name(spec) for spec in b.reward_columns}
    records = []
    for i in range(min(n, len(b))):
        rewards = {}
        for spec, col in b.reward_columns.items():
            v = float(col[i])
            rewards[names[spec]] = None if math.isnan(v) else v
        records.append({"step": step, "prompt": b.prompts[i], "completion": b.completions[i],
                        "reward": float(b.rewards[i]), "rewards": rewards, "advantage": row_advantage(b, i)})
        if b.gen.tool_calls is not None:
            records[-1]["tool_calls"] = b.gen.tool_calls[i]
        if b.gen.episodes is not None:   # in an environment: its turns and rewards
            records[-1]["episode"] = b.gen.episodes[i]
        if b.logged:   # what reward functions logged for this sample (log_extra, dict returns)
            records[-1]["logged"] = {k: v[i] for k, v in b.logged.items()}
    return records


def append_samples(path: Path, records: list[dict]) -> None:
    with open(path, "a") as f:
        for r in records:
            f.write(json.dumps(r, default=repr) + "\n")
