"""The rollout batch: everything one RL step knows about its samples, in one place."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .engine import Generation


@dataclass
class RolloutBatch:
    """Rows are grouped: the G completions of prompt i share group_ids == i.

    Everything downstream reads token ids from here; nothing re-tokenizes decoded text.
    """
    gen: Generation                       # padded prompt/completion ids, masks, sampler log-probs, truncated
    group_ids: torch.Tensor               # (B,) long
    prompts: list[str]                    # (B,) prompt text per row
    completions: list[str]                # (B,) decoded completion per row (special tokens dropped)
    columns: dict[str, list]              # dataset columns per row (e.g. 'answer'), passed to rewards
    rewards: torch.Tensor | None = None   # (B,) weighted total
    reward_columns: dict[str, torch.Tensor] = field(default_factory=dict)  # per function, NaN = not applicable
    advantages: torch.Tensor | None = None  # (B,)

    def __len__(self) -> int:
        return len(self.completions)

    @property
    def completion_mask(self) -> torch.Tensor:
        return self.gen.completion_mask
