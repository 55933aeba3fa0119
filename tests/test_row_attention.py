"""Decode attention by each row's length (models/row_attention.py): the cut of rows into runs is the
cheapest one, and attending run by run over each run's own columns gives what one call over every
column gives."""

import itertools

import torch
import torch.nn.functional as F

from grpolab.models.row_attention import attend_runs, runs


def _cost(parts, widths, call_cost):
    return sum((b - a) * max(widths[a:b]) + call_cost for a, b in parts)


def test_runs_is_the_cheapest_cut_of_the_rows():
    """Against every cut of up to 7 rows into contiguous runs, enumerated plainly."""
    g = torch.Generator().manual_seed(0)
    for trial in range(60):
        n = 1 + trial % 7
        widths = torch.randint(1, 300, (n,), generator=g).tolist()
        call_cost = [0, 48, 500][trial % 3]
        got = runs(widths, call_cost)
        assert [a for a, _, _ in got][0] == 0 and got[-1][1] == n
        assert all(got[i][1] == got[i + 1][0] for i in range(len(got) - 1))     # contiguous, in order
        assert all(w == max(widths[a:b]) for a, b, w in got)
        cheapest = min(_cost(list(zip((0,) + c, c + (n,))), widths, call_cost)
                       for k in range(n) for c in itertools.combinations(range(1, n), k))
        assert _cost([(a, b) for a, b, _ in got], widths, call_cost) == cheapest
    assert runs([5, 5, 5, 5], 48) == [(0, 4, 5)]                  # equal rows: one call
    assert runs([200, 200, 10, 10], 48) == [(0, 2, 200), (2, 4, 10)]


def test_attention_by_runs_equals_one_call_over_every_column():
    """Left-padded rows of different lengths (grouped-query heads): each run over its own last columns
    gives the rows' outputs of one masked call over all columns, to float rounding."""
    torch.manual_seed(0)
    B, H, KV, T, D = 6, 6, 2, 40, 16
    widths = [40, 7, 9, 33, 3, 12]
    q, k, v = torch.randn(B, H, 1, D), torch.randn(B, KV, T, D), torch.randn(B, KV, T, D)
    mask = torch.full((B, 1, 1, T), float("-inf"))
    for r, w in enumerate(widths):
        mask[r, :, :, T - w:] = 0.0
    full = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.3, enable_gqa=True)
    parts = runs(widths, 0)
    assert len(parts) > 1
    torch.testing.assert_close(attend_runs(q, k, v, mask, parts, 0.3), full, atol=1e-6, rtol=1e-5)
    # and each row as plain softmax(q k^T) v over its own keys
    for r, w in enumerate(widths):
        kr, vr = k[r, :, T - w:].repeat_interleave(H // KV, 0), v[r, :, T - w:].repeat_interleave(H // KV, 0)
        want = torch.softmax(q[r] @ kr.transpose(-1, -2) * 0.3, -1) @ vr
        torch.testing.assert_close(full[r], want, atol=1e-5, rtol=1e-5)
