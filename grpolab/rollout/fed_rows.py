"""Rows of a decode that are fed tokens instead of sampling them: a tool's result (tool_decode.py) or an
environment's reply (env_decode.py) enters the row's KV cache through the same forward passes the other rows
decode with, at the positions the trainer's re-scoring gives it."""

from __future__ import annotations

from collections import deque

import torch


class FedRows:
    """Each row's queue of tokens to feed, and where its current stretch of sampling began."""

    def __init__(self, rows: int, device) -> None:
        self.queues: list[deque] = [deque() for _ in range(rows)]
        self.seg_start = [0] * rows

    def feed(self, t: int, tok: torch.Tensor, lp: torch.Tensor) -> torch.Tensor:
        """Rows with queued tokens take their next one instead of their sample, with log-prob 0
        (`tok` and `lp` are changed in place); the (B,) mask of those rows."""
        is_fed = torch.zeros(tok.size(0), dtype=torch.bool, device=tok.device)
        fed = [i for i, q in enumerate(self.queues) if q]
        if fed:
            rows = torch.tensor(fed, device=tok.device)
            tok[rows] = torch.tensor([self.queues[i].popleft() for i in fed], device=tok.device)
            lp[rows] = 0.0
            is_fed[rows] = True
            for i in fed:
                self.seg_start[i] = t + 1
        return is_fed
