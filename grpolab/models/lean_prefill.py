"""Prompts prefilled packed: no padding, each prompt attending to itself only, a cached prefix reused.

A left-padded batch prefill pays every prompt's matrix products at the longest prompt's width (64 chat
prompts of 95 tokens on average padded to 171: 44 % of the work was padding). Here the new tokens of all
prompts are one (tokens, C) matrix for the projections and the MLP, and attention runs prompt by prompt
over that prompt's own keys (its cached prefix's, then its new tokens', causally). A prompt's keys,
values and last logits therefore depend on its tokens alone, not on which prompts were admitted with
it (the prepacked linear's rows are independent of the row count: lean_decode._Linear).

The result is each prompt's keys and values for every position, (layers, 2 KV, length, D), which the
server's batcher places in its frame and its prefix cache keeps (serve/prefix_cache.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .attention import rotate
from .lean_decode import LeanDecoder, hf_norm


def packed_prefill(d: LeanDecoder, new: list[list[int]], prefixes: list[torch.Tensor | None]
                   ) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Prefill prompt i's tokens `new[i]` (non-empty), which follow its cached `prefixes[i]` (layers, 2 KV,
    p_i, D), or None: nothing before. Returns each prompt's keys and values for all p_i + len(new[i])
    positions, and the next-token logits after each prompt (n, V)."""
    H, KV, D = d.n_head, d.n_kv, d.head_dim
    lens = [len(t) for t in new]
    starts = [0 if p is None else p.size(2) for p in prefixes]
    N = sum(lens)
    ids = torch.tensor([t for seq in new for t in seq], dtype=torch.long, device=d.device)
    pos = torch.cat([torch.arange(s, s + n, device=d.device) for s, n in zip(starts, lens)])
    cs = d.rope.index_select(0, pos)   # (N, 2, heads or 1, D)
    cos, sin = cs[:, 0], cs[:, 1]
    out = [torch.empty((d.n_layer, 2 * KV, s + n, D), dtype=d.dtype, device=d.device) for s, n in zip(starts, lens)]
    for o, p in zip(out, prefixes):
        if p is not None:
            o[:, :, :p.size(2)] = p
    x = F.embedding(ids, d.embed_w)
    for i, L in enumerate(d.layers):
        qkv = L.qkv(x).view(N, H + 2 * KV, D)
        if d.fused_rope:   # one pass rotates q and k and copies v (the table's identity for value heads)
            r = rotate(qkv, cos, sin)
            q, kv = r[:, :H], r[:, H:]
        else:              # Qwen3's per-head norms come before the rotation
            q = rotate(hf_norm(qkv[:, :H], L.q_norm), cos, sin)
            kv = torch.cat([rotate(hf_norm(qkv[:, H:H + KV], L.k_norm), cos, sin), qkv[:, H + KV:]], dim=1)
        y = torch.empty((N, H, D), dtype=d.dtype, device=d.device)
        at = 0
        for o, s, n in zip(out, starts, lens):
            o[i, :, s:s + n] = kv[at:at + n].transpose(0, 1)
            k, v = o[i, None, :KV, :s + n], o[i, None, KV:, :s + n]
            qi = q[at:at + n].transpose(0, 1)[None]
            # the new queries are the last n of s + n keys: causal from the bottom-right corner
            mask = None if s == 0 else torch.ones(n, s + n, dtype=torch.bool, device=d.device).tril_(s)
            y[at:at + n] = F.scaled_dot_product_attention(qi, k, v, attn_mask=mask, is_causal=s == 0,
                                                          scale=L.scaling, enable_gqa=KV != H)[0].transpose(0, 1)
            at += n
        x = L.o.residual(x, y.view(N, H * D))
        gate, up = L.gate_up(x).chunk(2, dim=-1)
        x = L.down.residual(x, F.silu(gate) * up)
    last = torch.tensor(lens, device=d.device).cumsum(0) - 1
    return out, d.head(x.index_select(0, last))


def prefill_in_pieces(d: LeanDecoder, prompts: list[list[int]], piece: int
                      ) -> tuple[list[torch.Tensor], torch.Tensor]:
    """`packed_prefill` of whole prompts, each cut at multiples of `piece` of its own positions (0: whole),
    round k packing every prompt's k-th piece: the activations stay (prompts x piece x ...) however long the
    prompts are, and a prompt's cuts, so its keys, values and logits, depend on it alone."""
    piece = piece if piece > 0 else max(map(len, prompts))
    kvs: list[torch.Tensor | None] = [None] * len(prompts)
    last: list[torch.Tensor | None] = [None] * len(prompts)
    for at in range(0, max(map(len, prompts)), piece):
        todo = [i for i, p in enumerate(prompts) if len(p) > at]
        out, logits = packed_prefill(d, [prompts[i][at:at + piece] for i in todo], [kvs[i] for i in todo])
        for n, i in enumerate(todo):
            kvs[i] = out[n]
            if len(prompts[i]) <= at + piece:
                last[i] = logits[n]
    return kvs, torch.stack(last)
