"""Per-row logits processors: logit bias, banned tokens, repetition / presence / frequency penalties,
and a constrained-decoding bitmask. Pure tensor functions over logits (B, V) and per-row settings,
applied before `sampling.sample_next` (vLLM's order: bias and bans, then penalties, then temperature,
top-k and top-p). Every one is row-wise, so a row's result never depends on the other rows.
"""

from __future__ import annotations

import sys

import numpy as np
import torch


def token_counts(tokens: list[list[int]], vocab: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """(B, V) float32: how often each token occurs in each row's list."""
    counts = torch.zeros(len(tokens), vocab, device=device)
    flat = [b * vocab + t for b, ids in enumerate(tokens) for t in ids]   # one index_add for all rows
    if flat:
        counts.view(-1).index_add_(0, torch.tensor(flat, device=device), torch.ones(len(flat), device=device))
    return counts


def add_bias(logits: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """logits + bias, bias (B, V) (OpenAI's logit_bias: 0 for the tokens not named)."""
    return logits + bias


def ban(logits: torch.Tensor, banned: torch.Tensor) -> torch.Tensor:
    """-inf where `banned` (B, V) bool is set (min_tokens: the stop tokens until enough are generated)."""
    return logits.clone().masked_fill_(banned, float("-inf"))   # in place: ~5x faster than masked_fill on a CPU


def penalize(logits: torch.Tensor, prompt_seen: torch.Tensor, counts: torch.Tensor, presence: torch.Tensor,
             frequency: torch.Tensor, repetition: torch.Tensor) -> torch.Tensor:
    """Repetition, then frequency and presence penalties (vLLM's definitions), per row b and token v:

        seen      = prompt_seen[b, v] or counts[b, v] > 0            (in the prompt or the output so far)
        l'        = l / repetition[b]  if seen and l > 0
                    l * repetition[b]  if seen and l <= 0            (CTRL, Keskar et al. 2019; HF's rule)
                    l                  otherwise
        l''       = l' - frequency[b] * counts[b, v] - presence[b] * (counts[b, v] > 0)   (OpenAI's formula)

    counts: (B, V) how often each token occurs in the row's output so far (the prompt does not count for
    presence/frequency); presence, frequency, repetition: (B,). repetition 1 and presence = frequency = 0
    leave a row as it is.
    """
    rep = repetition[:, None]
    seen = prompt_seen | (counts > 0)
    # only the columns some row has seen can change (elsewhere l - 0 - 0 = l): compute on those alone
    cols = seen.any(0).nonzero().squeeze(1)
    x, n, s = logits[:, cols], counts[:, cols], seen[:, cols]
    x = torch.where(s, torch.where(x > 0, x / rep, x * rep), x)
    out = logits.clone()
    out[:, cols] = x - frequency[:, None] * n - presence[:, None] * (n > 0).to(x.dtype)
    return out


def unpack_bitmask(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """(B, V) bool from a packed (B, ceil(V / 32)) int32 bitmask: token v allowed when bit v % 32 of
    word v // 32 is set (the layout llguidance, xgrammar and outlines-core write). On a little-endian
    host that is bit v % 8 of byte v // 8, which numpy unpacks ~10x faster than shifting in torch."""
    if sys.byteorder == "little" and bitmask.device.type == "cpu":
        raw = bitmask.contiguous().numpy().view(np.uint8)
        return torch.from_numpy(np.unpackbits(raw, axis=1, count=vocab, bitorder="little").view(np.bool_))
    bits = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    return ((bitmask[:, :, None] >> bits) & 1).bool().flatten(1)[:, :vocab]


def allow_only(logits: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """-inf outside `allowed` (B, V) bool (a grammar's next-token mask); columns past it are not allowed."""
    if allowed.size(-1) < logits.size(-1):
        allowed = torch.nn.functional.pad(allowed, (0, logits.size(-1) - allowed.size(-1)))
    return logits.clone().masked_fill_(~allowed, float("-inf"))
