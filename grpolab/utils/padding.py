"""Padding, in one place: token lists to a padded batch, and a padded batch to a wider one.

Convention (see models/gpt.py): prompts are left-padded, completions right-padded.
"""

from __future__ import annotations

import torch


def pad_sequences(seqs: list[list[int]], pad_id: int, side: str = "left") -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, mask), both (len(seqs), longest): `ids` long, filled with pad_id outside each
    sequence; `mask` bool, True at real tokens. `side` is where the padding goes."""
    if side not in ("left", "right"):
        raise ValueError(f"side must be 'left' or 'right', got {side!r}")
    width = max((len(s) for s in seqs), default=0)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.bool)
    for i, s in enumerate(seqs):
        if s:
            cols = slice(width - len(s), width) if side == "left" else slice(0, len(s))
            ids[i, cols] = torch.as_tensor(s, dtype=torch.long)
            mask[i, cols] = True
    return ids, mask


def pad_to_width(t: torch.Tensor, width: int, value: float | int | bool, side: str = "right") -> torch.Tensor:
    """`t` (B, T) widened to (B, width) with `value` on `side` (dtype, device and autograd kept);
    returned as is when already that wide."""
    if side not in ("left", "right"):
        raise ValueError(f"side must be 'left' or 'right', got {side!r}")
    extra = width - t.size(1)
    if extra == 0:
        return t
    if extra < 0:
        raise ValueError(f"cannot pad a tensor {t.size(1)} wide to {width}")
    pad = torch.full((t.size(0), extra), value, dtype=t.dtype, device=t.device)
    return torch.cat([pad, t] if side == "left" else [t, pad], dim=1)
