"""The critic for PPO (algorithm.adv_estimator=gae): a backbone of the policy's architecture with
its own weights, and a scalar value head on its last hidden states."""

from __future__ import annotations

import torch
import torch.nn as nn


def hidden_size(model) -> int:
    c = model.config
    return getattr(c, "n_embd", None) or c.hidden_size


class Critic(nn.Module):
    """V(prompt, completion[:t]) for every completion position t: the value of the state in which
    completion token t is chosen (the hidden state that predicts it)."""

    def __init__(self, backbone: nn.Module) -> None:
        super().__init__()
        self.backbone = backbone
        self.v_head = nn.Linear(hidden_size(backbone), 1)
        nn.init.zeros_(self.v_head.weight)   # starts at V = 0: no made-up value before it has learned
        nn.init.zeros_(self.v_head.bias)

    def forward(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, completion_ids: torch.Tensor,
                completion_mask: torch.Tensor, context_mask: torch.Tensor | None = None) -> torch.Tensor:
        """(B, C) values, 0 at masked positions, float32. One forward over [left-padded prompt |
        completion]; the hidden state at position P - 1 + t is the state before completion token t.
        context_mask: the completion tokens attended to, tool outputs included (default completion_mask)."""
        C = completion_ids.size(1)
        ids = torch.cat([prompt_ids, completion_ids], dim=1)
        valid = torch.cat([prompt_mask, completion_mask if context_mask is None else context_mask], dim=1)
        h = self.backbone(ids[:, :-1], key_valid=valid[:, :-1], logits_to_keep=C, hidden=True)
        v = self.v_head(h.to(self.v_head.weight.dtype)).squeeze(-1).float()
        return v * completion_mask
