"""Sampling randomness keyed by what a completion is, not by where it sits in a batch.

Each completion gets a 32-bit key from (seed, prompt draw, sample index); the uniform for its
t-th token is a hash of (key, t). So the same seed gives the same completions whether a step's
prompts are sampled in one batch or split over ranks, micro-batches or chunks, and a resumed run
draws what the uninterrupted one would have. The hash is integer arithmetic on int64 tensors
(lowbias32, Wellons 2018), so it is the same on every device and torch build.
"""

from __future__ import annotations

import torch

_M32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor, m: int) -> torch.Tensor:
    """(x * m) mod 2^32 for x in [0, 2^32), without int64 overflow: x split into 16-bit halves."""
    lo, hi = x & 0xFFFF, x >> 16
    return (lo * m + (((hi * m) & 0xFFFF) << 16)) & _M32


def mix32(x: torch.Tensor) -> torch.Tensor:
    """lowbias32: a bijective 32-bit mixer with good avalanche; x int64 in [0, 2^32)."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def completion_keys(seed: int, draws: torch.Tensor, samples: torch.Tensor) -> torch.Tensor:
    """(B,) int64 keys of completions: sample `samples[i]` of the prompt drawn `draws[i]`-th.

    Keys are 32 bits: among a million completions a few dozen share a key, and so share their
    uniforms; their prompts differ, so their completions do too."""
    h = mix32(torch.full_like(draws, seed & _M32) ^ 0x5EED)
    if seed >> 32:   # seeds beyond 32 bits (and negative ones) get their high bits folded in too
        h = mix32(h ^ ((seed >> 32) & _M32))
    h = mix32(h ^ (draws & _M32))
    h = mix32(h ^ ((draws >> 32) & _M32))
    return mix32(h ^ (samples & _M32))


def position_salts(t: torch.Tensor) -> torch.Tensor:
    """The hash of token positions `t` (int64) that `token_uniforms` mixes into each key."""
    return mix32((t + 0x9E3779B9) & _M32)


def salted_uniforms(keys: torch.Tensor, salts: torch.Tensor | int) -> torch.Tensor:
    """(B, 1) float64 uniforms in [0, 1) of keyed completions at positions given by their salts."""
    return (mix32(keys ^ salts).to(torch.float64) / 2.0 ** 32)[:, None]


def token_uniforms(keys: torch.Tensor, t: int | torch.Tensor) -> torch.Tensor:
    """(B, 1) float64 uniforms in [0, 1) for token position t of each keyed completion (`t` (B,):
    each row its own position, as when rows of different ages decode together)."""
    if isinstance(t, torch.Tensor):
        return salted_uniforms(keys, position_salts(t.to(keys.device)))
    return salted_uniforms(keys, int(position_salts(torch.tensor([t]))[0]))
