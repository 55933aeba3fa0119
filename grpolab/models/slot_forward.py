"""The forward passes of a slotted decode over `DecodeWeights` (models/decode_weights.py): a prompt's
prefill, and one new token per row over a `SlotCache`.

Both follow the models' own math (Hugging Face's RMSNorm in float32 then its weight; the built-in
GPT's parameter-free norm; rotary positions; grouped-query heads), agreeing with their forwards to
float rounding. What is particular is that every result a row gets is computed by the same kernels at
the same shapes whoever shares its batch, so its completion does not depend on the batch:
- a prompt is prefilled alone, padded to a length that depends on it alone (its G samples get its keys
  and values);
- a decode step's matrix products run in blocks of exactly `rows_per_matmul` rows (the decode batch is
  a multiple of it), since a library GEMM picks its tiling, and so its rounding, from the row count;
- the norms, the rotation and the attention read one row per program (models/decode_kernels.py,
  models/decode_attention.py), attention walking only the row's own keys.
A decode step is few kernels per layer (the fused ones, and the residual adds inside the products),
since on a GPU each kernel, even inside a CUDA graph, costs microseconds whatever its work.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .attention import rotate
from .decode_attention import decode_attention
from .decode_kernels import rms_norm, rope_store, silu_mul
from .decode_weights import DecodeWeights, LayerWeights
from .slot_cache import SlotCache


def _norm(x: torch.Tensor, w: torch.Tensor | None, W: DecodeWeights) -> torch.Tensor:
    return rms_norm(x, w, W.eps, W.upcast)


def _project(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, rows: int) -> torch.Tensor:
    """x @ w.T + b, in blocks of `rows` rows (0: one product), written into one output."""
    if not rows:
        return F.linear(x, w, b)
    out = x.new_empty(x.size(0), w.size(0))
    for i in range(0, x.size(0), rows):
        if b is None:
            torch.mm(x[i:i + rows], w.t(), out=out[i:i + rows])
        else:
            torch.addmm(b, x[i:i + rows], w.t(), out=out[i:i + rows])
    return out


def _add_project(x: torch.Tensor, h: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, rows: int) -> torch.Tensor:
    """x + h @ w.T + b, the residual add inside the product (in place, x (N, C) contiguous)."""
    step = rows or x.size(0)
    for i in range(0, x.size(0), step):
        x[i:i + step].addmm_(h[i:i + step], w.t())
    return x if b is None else x.add_(b)


def _mlp(x: torch.Tensor, L: LayerWeights, W: DecodeWeights, rows: int) -> torch.Tensor:
    h = _project(_norm(x, L.norm2, W), L.up, L.up_b, rows)
    return _add_project(x, silu_mul(h) if W.gated else F.gelu(h), L.down, L.down_b, rows)


def _qk_norms(qkv: torch.Tensor, L: LayerWeights, W: DecodeWeights) -> None:
    """Qwen3's per-head norms of the queries and keys, in place in qkv (N, (H + 2KV) * D)."""
    H, KV, D = W.n_head, W.n_kv, W.head_dim
    x = qkv.view(-1, H + 2 * KV, D)
    x[:, :H] = _norm(x[:, :H].reshape(-1, D), L.q_norm, W).view(-1, H, D)
    x[:, H:H + KV] = _norm(x[:, H:H + KV].reshape(-1, D), L.k_norm, W).view(-1, KV, D)


def _logits(x: torch.Tensor, W: DecodeWeights, rows: int) -> torch.Tensor:
    return _project(_norm(x, W.norm, W), W.head, W.head_b, rows)


def prefill(W: DecodeWeights, ids: torch.Tensor, last: torch.Tensor, cache: SlotCache,
            slots: torch.Tensor) -> torch.Tensor:
    """Run one prompt alone: `ids` (Pp,) its tokens, padded after its end to a length that depends on it
    alone (slot_decode pads to a multiple of 64: one capture serves every prompt of that length); `last`
    (1,) the index of its last token. Its keys and values at positions [0, Pp) go to the cache rows `slots`
    (G,) (its samples; the padding's are overwritten as the completion grows, never read before). Returns
    the next-token logits (V,) after its last token. Every index is a tensor: a CUDA graph can replay it."""
    Pp = ids.numel()
    H, KV, D = W.n_head, W.n_kv, W.head_dim
    cos, sin = W.cos[:Pp][:, None], W.sin[:Pp][:, None]
    at = (slots[:, None] * cache.T + torch.arange(Pp, device=ids.device)).reshape(-1)   # (G * Pp,) cache rows
    x = F.embedding(ids, W.embed)
    for i, L in enumerate(W.layers):
        qkv = _project(_norm(x, L.norm1, W), L.qkv, L.qkv_b, 0)
        if L.q_norm is not None:
            _qk_norms(qkv, L, W)
        qkv = qkv.view(Pp, H + 2 * KV, D)
        q, k, v = rotate(qkv[:, :H], cos, sin), rotate(qkv[:, H:H + KV], cos, sin), qkv[:, H + KV:]
        cache.k[i].view(-1, KV, D).index_copy_(0, at, k.repeat(slots.numel(), 1, 1))
        cache.v[i].view(-1, KV, D).index_copy_(0, at, v.repeat(slots.numel(), 1, 1))
        # (1, heads, Pp, D); key/value heads repeated for their query groups; causal, so no token sees the padding
        kk, vv = (t.repeat_interleave(H // KV, dim=1).transpose(0, 1)[None] for t in (k, v))
        y = F.scaled_dot_product_attention(q.transpose(0, 1)[None], kk, vv, is_causal=True, scale=W.scale)
        x = _add_project(x, y[0].transpose(0, 1).reshape(Pp, -1), L.o, L.o_b, 0)
        x = _mlp(x, L, W, 0)
    return _logits(x.index_select(0, last), W, 0)[0]


def decode(W: DecodeWeights, cache: SlotCache, tok: torch.Tensor, rows_per_matmul: int) -> torch.Tensor:
    """One token per row for rows [0, b) of the cache (tok (b,)): each token's keys and values written at
    its row's length and attended with the row's own keys; returns the next-token logits (b, V). The
    caller advances `cache.lens` of the rows that go on."""
    b, rows = tok.numel(), rows_per_matmul
    lens = cache.lens[:b]
    seen = lens + 1   # keys each row attends to: its cache and the new token
    x = F.embedding(tok, W.embed)
    for i, L in enumerate(W.layers):
        qkv = _project(_norm(x, L.norm1, W), L.qkv, L.qkv_b, rows)
        if L.q_norm is not None:
            _qk_norms(qkv, L, W)
        q = rope_store(qkv, W.cos, W.sin, lens, cache.k[i], cache.v[i], W.n_head, W.n_kv)
        y = decode_attention(q, cache.k[i][:b], cache.v[i][:b], seen, W.scale)
        x = _add_project(x, y.view(b, -1), L.o, L.o_b, rows)
        x = _mlp(x, L, W, rows)
    return _logits(x, W, rows)
