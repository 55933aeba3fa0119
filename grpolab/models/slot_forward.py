"""The forward passes of a slotted decode over `DecodeWeights` (models/decode_weights.py): a prompt's
prefill, and one new token per row over a `SlotCache`.

Both follow the models' own math (Hugging Face's RMSNorm in float32 then its weight; the built-in
GPT's parameter-free norm; rotary positions; grouped-query heads), agreeing with their forwards to
float rounding. What is particular is that every result a row gets is computed by the same kernels at
the same shapes whoever shares its batch, so its completion does not depend on the batch:
- a prompt is prefilled alone, at its own length (its G samples then copy its keys and values);
- a decode step's matrix products run in blocks of exactly `rows_per_matmul` rows (the decode batch is
  a multiple of it), since a library GEMM picks its tiling, and so its rounding, from the row count;
- attention walks each row's own keys (models/decode_attention.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .attention import rotate
from .decode_attention import decode_attention
from .decode_weights import DecodeWeights, LayerWeights
from .slot_cache import SlotCache


def _norm(x: torch.Tensor, w: torch.Tensor | None, W: DecodeWeights) -> torch.Tensor:
    if W.upcast:
        y = F.rms_norm(x.float(), (x.size(-1),), eps=W.eps).to(x.dtype)
    else:
        y = F.rms_norm(x, (x.size(-1),), eps=W.eps)
    return y if w is None else w * y


def _linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, rows: int) -> torch.Tensor:
    """x @ w.T + b, in blocks of `rows` rows (0: one product)."""
    if not rows or x.size(0) == rows:
        return F.linear(x, w, b)
    return torch.cat([F.linear(part, w, b) for part in x.split(rows)])


def _mlp(x: torch.Tensor, L: LayerWeights, W: DecodeWeights, rows: int) -> torch.Tensor:
    h = _linear(_norm(x, L.norm2, W), L.up, L.up_b, rows)
    if W.gated:
        gate, up = h.chunk(2, dim=-1)
        h = F.silu(gate) * up
    else:
        h = F.gelu(h)
    return x + _linear(h, L.down, L.down_b, rows)


def _qkv(x: torch.Tensor, L: LayerWeights, W: DecodeWeights, cos: torch.Tensor, sin: torch.Tensor, rows: int):
    """Queries (N, H, D), keys and values (N, KV, D) of N tokens, rotated at their positions (cos/sin (N, 1, D))."""
    H, KV, D = W.n_head, W.n_kv, W.head_dim
    qkv = _linear(_norm(x, L.norm1, W), L.qkv, L.qkv_b, rows).view(-1, H + 2 * KV, D)
    q, k, v = qkv[:, :H], qkv[:, H:H + KV], qkv[:, H + KV:]
    if L.q_norm is not None:
        q, k = _norm(q, L.q_norm, W), _norm(k, L.k_norm, W)
    return rotate(q, cos, sin), rotate(k, cos, sin), v


def _logits(x: torch.Tensor, W: DecodeWeights, rows: int) -> torch.Tensor:
    return _linear(_norm(x, W.norm, W), W.head, W.head_b, rows)


def prefill(W: DecodeWeights, ids: torch.Tensor, cache: SlotCache, rows: slice) -> torch.Tensor:
    """Run one prompt `ids` (P,) alone, write its keys and values to the cache `rows` (its samples), set
    their lengths to P, and return the next-token logits (V,) after it."""
    P = ids.numel()
    H, KV = W.n_head, W.n_kv
    pos = torch.arange(P, device=ids.device)
    cos, sin = W.cos[pos][:, None], W.sin[pos][:, None]
    x = F.embedding(ids, W.embed)
    for i, L in enumerate(W.layers):
        q, k, v = _qkv(x, L, W, cos, sin, 0)
        cache.fill(i, rows, k, v)
        # (1, heads, P, D); key/value heads repeated for their query groups
        kk, vv = (t.repeat_interleave(H // KV, dim=1).transpose(0, 1)[None] for t in (k, v))
        y = F.scaled_dot_product_attention(q.transpose(0, 1)[None], kk, vv, is_causal=True, scale=W.scale)
        x = x + F.linear(y[0].transpose(0, 1).reshape(P, -1), L.o, L.o_b)
        x = _mlp(x, L, W, 0)
    cache.lens[rows] = P
    return _logits(x[-1:], W, 0)[0]


def decode(W: DecodeWeights, cache: SlotCache, tok: torch.Tensor, rows_per_matmul: int) -> torch.Tensor:
    """One token per row for rows [0, b) of the cache (tok (b,)): each token's keys and values written at
    its row's length and attended with the row's own keys; returns the next-token logits (b, V). The
    caller advances `cache.lens` of the rows that go on."""
    b = tok.numel()
    lens = cache.lens[:b]
    cos, sin = W.cos[lens][:, None], W.sin[lens][:, None]
    x = F.embedding(tok, W.embed)
    for i, L in enumerate(W.layers):
        q, k, v = _qkv(x, L, W, cos, sin, rows_per_matmul)
        cache.write(i, b, k, v)
        y = decode_attention(q, cache.k[i][:b], cache.v[i][:b], lens + 1, W.scale)
        x = x + _linear(y.reshape(b, -1), L.o, L.o_b, rows_per_matmul)
        x = _mlp(x, L, W, rows_per_matmul)
    return _logits(x, W, rows_per_matmul)
