"""What a rollout returns: prompts, sampled completions and their masks, the sampler's log-probs."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from ..utils.padding import pad_to_width

# the per-row records that are lists, not tensors
LISTS = ("tool_calls", "episodes")


@dataclass
class Generation:
    prompt_ids: torch.Tensor        # (B, P) left-padded with pad_id, B = num_prompts * G
    prompt_mask: torch.Tensor       # (B, P) bool, True at real prompt tokens
    completion_ids: torch.Tensor    # (B, C) right-padded with pad_id
    completion_mask: torch.Tensor   # (B, C) bool, True up to and including the stop token
    sampler_logprobs: torch.Tensor  # (B, C) log-prob of each sampled token (0 where masked)
    truncated: torch.Tensor         # (B,) bool, True when no stop token within max_new_tokens
    tool_mask: torch.Tensor | None = None  # (B, C) bool, True at tokens tools wrote (context: no loss, no KL)
    tool_calls: list | None = None  # (B,) with tools: each row's calls, [{name, arguments, output, error}]
    episodes: list | None = None    # (B,) in an environment: each row's episode, {turns, rewards, reward, done}

    def __post_init__(self) -> None:
        if self.tool_mask is None:
            self.tool_mask = torch.zeros_like(self.completion_mask)

    @property
    def context_mask(self) -> torch.Tensor:
        """(B, C) bool: every real completion token, the tools' included (what the model attends to)."""
        return self.completion_mask | self.tool_mask

    def id_lists(self) -> list[list[int]]:
        """Each completion's token ids, stop token included, no padding; with tools, the tools' tokens
        too, in place (what rewards and decoded texts see)."""
        return [ids[m].tolist() for ids, m in zip(self.completion_ids.cpu(), self.context_mask.cpu())]

    def tensors(self) -> dict[str, torch.Tensor]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in LISTS}

    def rows(self, lo: int, hi: int) -> Generation:
        """Rows lo..hi-1 (padding as it is)."""
        return Generation(**{k: t[lo:hi] for k, t in self.tensors().items()},
                          **{k: None if getattr(self, k) is None else getattr(self, k)[lo:hi] for k in LISTS})

    def to(self, device) -> Generation:
        return Generation(**{k: t.to(device) for k, t in self.tensors().items()},
                          **{k: getattr(self, k) for k in LISTS})


def cat_generations(gens: list[Generation], pad_id: int) -> Generation:
    """One Generation from several, rows in order: prompts re-padded on the left, completions on the right
    (the same tensors one call over all the prompts gives: padding is all that differs)."""
    if len(gens) == 1:
        return gens[0]
    P = max(g.prompt_ids.size(1) for g in gens)
    C = max(g.completion_ids.size(1) for g in gens)
    return Generation(
        prompt_ids=torch.cat([pad_to_width(g.prompt_ids, P, pad_id, "left") for g in gens]),
        prompt_mask=torch.cat([pad_to_width(g.prompt_mask, P, False, "left") for g in gens]),
        completion_ids=torch.cat([pad_to_width(g.completion_ids, C, pad_id, "right") for g in gens]),
        completion_mask=torch.cat([pad_to_width(g.completion_mask, C, False, "right") for g in gens]),
        sampler_logprobs=torch.cat([pad_to_width(g.sampler_logprobs, C, 0.0, "right") for g in gens]),
        truncated=torch.cat([g.truncated for g in gens]),
        tool_mask=torch.cat([pad_to_width(g.tool_mask, C, False, "right") for g in gens]),
        **{k: None if any(getattr(g, k) is None for g in gens) else [c for g in gens for c in getattr(g, k)]
           for k in LISTS})
