"""Token sampling: temperature, top-k, top-p, and the log-probs the trainer will compare against."""

from __future__ import annotations

import torch


def filter_logits(logits: torch.Tensor, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """Set logits outside the top-k / nucleus (top-p) set to -inf. logits: (B, V), already tempered."""
    if top_k and top_k < logits.size(-1):
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        # drop a token when the mass strictly before it already reaches top_p (the first token always stays)
        drop_sorted = probs.cumsum(-1) - probs >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


BLOCK = 256   # draw() inverts the CDF per block of this many tokens when the vocabulary is larger


def draw(probs: torch.Tensor, generator: torch.Generator | None, u: torch.Tensor | None = None,
         block: int = BLOCK) -> torch.Tensor:
    """One token per row of `probs` (B, V) by inverting the CDF with one uniform per row
    (`u` (B, 1) float64 when given, e.g. keyed uniforms; else drawn from `generator`).

    `torch.multinomial` draws an exponential for every vocabulary entry, which on a CPU
    costs more than a tiny model's whole decode step; this needs B random numbers.
    Vocabularies up to 4 blocks take one float64 cumulative sum. Larger ones go in two levels:
    the uniform picks a block of `block` tokens by the blocks' sums, then a token inside it by
    that block's own float64 cumulative sum, rescaled to it. A (64, 32k) float64 cumulative sum
    costs ~2.7 ms on 2 CPU cores; this touches the whole row once (float32 block sums) and
    (B, block) after, and the whole `sample_next` at that shape takes ~2.4 ms. Either way a token of zero
    probability has an empty interval and is never drawn, and rounding cannot give measurable
    mass to near-zero tokens even over 150k-entry vocabularies.
    """
    B, V = probs.shape
    if u is None:
        u = torch.rand(B, 1, generator=generator, dtype=torch.float64, device=probs.device)
    u = u.to(probs.device)
    if V <= 4 * block:
        cdf = probs.cumsum(-1, dtype=torch.float64)
        # first index whose CDF exceeds u * total
        tok = torch.searchsorted(cdf, u * cdf[:, -1:], right=True)
        return tok.clamp_(max=V - 1).squeeze(-1)
    n = V // block
    sums = probs[:, :n * block].reshape(B, n, block).sum(-1)
    if V % block:
        sums = torch.cat([sums, probs[:, n * block:].sum(-1, keepdim=True)], dim=1)
    return invert_blocks(sums, lambda idx: probs.gather(1, idx.clamp(max=V - 1)).masked_fill_(idx >= V, 0.0), u,
                         block)


def invert_blocks(sums: torch.Tensor, block_probs, u: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    """`draw`'s two levels: the uniform picks a block of `block` tokens by the blocks' masses `sums`
    (B, blocks), then a token inside it by `block_probs(idx)` (idx (B, block) the block's token ids, some
    past the vocabulary in the last block: their probabilities 0)."""
    ends = sums.cumsum(-1, dtype=torch.float64)            # (B, blocks): where each block's mass ends
    edges = torch.nn.functional.pad(ends, (1, 0))         # (B, blocks + 1), from 0
    target = u * ends[:, -1:]
    blk = torch.searchsorted(ends, target, right=True).clamp_(max=sums.size(1) - 1)   # (B, 1)
    lo, hi = edges.gather(1, blk), edges.gather(1, blk + 1)
    inside = block_probs(blk * block + torch.arange(block, device=sums.device))
    cdf = inside.cumsum(-1, dtype=torch.float64)
    # where the target falls inside the block, as a fraction of it (below 1, so it lands on a token
    # of the block with probability > 0 even when the block's two sums round differently)
    frac = ((target - lo) / (hi - lo).clamp_min(1e-300)).clamp_(0.0, 1.0 - 2.0 ** -53)
    j = torch.searchsorted(cdf, frac * cdf[:, -1:], right=True).clamp_(max=block - 1)
    return (blk * block + j).squeeze(-1)


def sample_next(logits: torch.Tensor, temperature: float, top_k: int, top_p: float,
                generator: torch.Generator | None, u: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick one token per row from logits (B, V).

    Returns (tokens (B,), logprobs (B,)). The log-prob is that of the temperature-scaled
    full distribution, log softmax(logits / T), which is exactly what the trainer
    recomputes; top-k/top-p only restrict which tokens can be drawn. temperature 0
    means greedy, with log-probs taken at T = 1. `u` (B, 1): the rows' uniforms, when keyed.
    """
    logits = logits.float()
    if temperature <= 0:
        logp = logits.log_softmax(-1)
        tok = logits.argmax(-1)
    else:
        scaled = logits / temperature if temperature != 1.0 else logits
        logp = scaled.log_softmax(-1)
        filtered = top_k or top_p < 1.0
        probs = filter_logits(scaled, top_k, top_p).softmax(-1) if filtered else logp.exp()
        tok = draw(probs, generator, u)
    return tok, logp.gather(-1, tok[:, None]).squeeze(-1)
