"""A preallocated KV cache of slots: one row per sequence, its tokens left-aligned from column 0.

`k[layer]` and `v[layer]` are (rows, T, kv_heads, D); `lens` (rows,) is how many positions each row has
filled, which is also the position (RoPE) of its next token: nothing is padding, so a row's keys sit in
the same columns whatever else shares the cache. Each row's new token is written at its own length
(models/decode_kernels.rope_store), so rows need not be of one age; rows leave by `compact`, which moves
the kept ones to the front.
Allocated once for a decode and read by fixed addresses, which is what a CUDA graph captures.
"""

from __future__ import annotations

import torch


class SlotCache:
    def __init__(self, n_layer: int, rows: int, T: int, n_kv: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.k = [torch.zeros(rows, T, n_kv, head_dim, dtype=dtype, device=device) for _ in range(n_layer)]
        self.v = [torch.zeros_like(self.k[0]) for _ in range(n_layer)]
        self.lens = torch.zeros(rows, dtype=torch.long, device=device)
        self.rows, self.T = rows, T

    def compact(self, order: torch.Tensor) -> None:
        """Rows [0, len(order)) become the rows `order` (indices), the rest keep stale values."""
        n = order.numel()
        for t in (*self.k, *self.v):
            t[:n] = t.index_select(0, order)
        self.lens[:n] = self.lens.index_select(0, order)
