"""Attention inputs shared by the built-in GPT and the lean HF decode path: the rotary
rotation and the mask over a left-to-right filled KV cache."""

from __future__ import annotations

import torch


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE in the halves layout, x: (B, heads, T, D). With cos = [c, c] and sin = [-s, s] over
    the head dim, x * cos + roll(x, D/2) * sin == [x1*c - x2*s, x2*c + x1*s]: three ops."""
    return torch.addcmul(x * cos, x.roll(x.size(-1) // 2, -1), sin)


def cache_mask(key_valid: torch.Tensor, start: int, end: int, decode: bool) -> torch.Tensor:
    """Boolean mask (B, 1, T, end) for queries at absolute positions [start, end).

    key_valid: (B, end), True at real (non-padding) keys. Query i may see key j if j is real
    and not in its future; a query always sees itself, so rows of pure padding stay finite.
    `decode`: one new real token per row, whose past is every real cached key.
    """
    if decode:
        return key_valid[:, None, None, :]
    q_pos = torch.arange(start, end, device=key_valid.device)
    k_pos = torch.arange(end, device=key_valid.device)
    causal = k_pos[None, :] <= q_pos[:, None]
    return ((causal[None] & key_valid[:, None, :]) | (k_pos[None, :] == q_pos[:, None])[None])[:, None]
