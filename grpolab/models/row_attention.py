"""Decode attention that reads each row's own length, on a CPU.

A batch's rows write their next token at one shared column, and a row's real tokens are the last
`count` columns before it (prompts are left-padded). One attention call over every column makes each row
pay for the longest one. Here the rows are cut into contiguous runs, and each run attends over only the
columns its longest row needs. The cut minimises the work: the sum over runs of rows x columns, plus
`CALL_COST` for each kernel call. It is computed from the counts alone, so the same batch is always cut
the same way.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# one more attention call costs about what this many (row, column) pairs cost: ~10 us per call against
# ~0.25 us per pair, SmolLM2's heads, torch's CPU flash kernel, one thread (this project's 2-core machine)
CALL_COST = 48


def runs(widths: list[int], call_cost: int = CALL_COST) -> list[tuple[int, int, int]]:
    """(start, stop, columns) runs of contiguous rows, covering them in order, that minimise
    sum((stop - start) * columns) + call_cost * len(runs), where a run's columns are its widest row's."""
    n = len(widths)
    best = [0] * (n + 1)   # best[j]: the least cost of rows [0, j)
    cut = [0] * (n + 1)
    for j in range(1, n + 1):
        wide, best[j] = 0, None
        for i in range(j - 1, -1, -1):   # the last run is [i, j)
            wide = max(wide, widths[i])
            cost = best[i] + (j - i) * wide + call_cost
            if best[j] is None or cost < best[j]:
                best[j], cut[j] = cost, i
    out, j = [], n
    while j > 0:
        i = cut[j]
        out.append((i, j, max(widths[i:j])))
        j = i
    return out[::-1]


def attend_runs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                parts: list[tuple[int, int, int]], scale: float) -> torch.Tensor:
    """One query per row: q (B, H, 1, D) against k, v (B, KV, T, D) and the additive mask (B, 1, 1, T), each
    run of rows over its last `columns` columns only. Returns (B, H, 1, D)."""
    if len(parts) == 1 and parts[0][2] == k.size(2):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=k.size(1) != q.size(1))
    y = q.new_empty(q.shape)
    T = k.size(2)
    for a, b, w in parts:
        y[a:b] = F.scaled_dot_product_attention(q[a:b], k[a:b, :, T - w:], v[a:b, :, T - w:],
                                                attn_mask=mask[a:b, :, :, T - w:], scale=scale,
                                                enable_gqa=k.size(1) != q.size(1))
    return y
