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


def draw(probs: torch.Tensor, generator: torch.Generator | None, u: torch.Tensor | None = None) -> torch.Tensor:
    """One token per row of `probs` (B, V) by inverting the CDF with one uniform per row
    (`u` (B, 1) float64 when given, e.g. keyed uniforms; else drawn from `generator`).

    `torch.multinomial` draws an exponential for every vocabulary entry, which on a CPU
    costs more than a tiny model's whole decode step; this needs B random numbers. The
    cumulative sum is taken in float64 so that rounding cannot give measurable mass to
    zero- or near-zero-probability tokens even over 150k-entry vocabularies.
    """
    cdf = probs.cumsum(-1, dtype=torch.float64)
    if u is None:
        u = torch.rand(probs.size(0), 1, generator=generator, dtype=torch.float64, device=probs.device)
    u = u.to(probs.device)
    # first index whose CDF exceeds u * total: tokens of zero probability have an empty interval
    tok = torch.searchsorted(cdf, u * cdf[:, -1:], right=True)
    return tok.clamp_(max=probs.size(-1) - 1).squeeze(-1)


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
