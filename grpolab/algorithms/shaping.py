"""Reward shaping and batch filtering helpers (pure functions on tensors), from DAPO (Yu et al. 2025).

overlong_penalty       soft overlong punishment added to the reward of long completions
dynamic_sampling_keep  drop groups whose rewards are all equal (they have zero advantage)
"""

from __future__ import annotations

import torch


def overlong_penalty(lengths: torch.Tensor, max_new_tokens: int, buffer: int, penalty: float = 1.0) -> torch.Tensor:
    """DAPO soft overlong punishment (Yu et al. 2025), scaled by `penalty`, per completion (B,):

                  0                                   if L <= L_max - L_cache
        R(L) =    ((L_max - L_cache) - L) / L_cache   if L_max - L_cache < L <= L_max
                  -1                                  if L > L_max
    times penalty, with L_max = max_new_tokens and L_cache = buffer (so -penalty at exactly
    L_max). buffer <= 0 turns it off (all zeros). lengths: completion lengths in tokens (B,).
    The result is added to the task reward before advantages are computed.
    """
    L = lengths.to(torch.float32)
    if buffer <= 0:
        return torch.zeros_like(L)
    start = max_new_tokens - buffer
    frac = ((L - start) / buffer).clamp(0.0, 1.0)
    return -penalty * frac


def dynamic_sampling_keep(rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """DAPO dynamic sampling filter (Yu et al. 2025; keeps 0 < #correct < G): bool (N,),
    True for the rows of groups whose rewards are not all equal. Groups of one and groups of
    identical rewards have zero advantage under every estimator and are dropped.
    """
    _, inv = torch.unique(group_ids, return_inverse=True)
    k = int(inv.max()) + 1 if inv.numel() else 0
    r = rewards.double()
    hi = torch.full((k,), -torch.inf, dtype=r.dtype, device=r.device).scatter_reduce(0, inv, r, "amax")
    lo = torch.full((k,), torch.inf, dtype=r.dtype, device=r.device).scatter_reduce(0, inv, r, "amin")
    return (hi != lo)[inv]
