"""The built-in tiny GPT: decoder-only transformer with RoPE, RMSNorm and a KV cache.

Small enough to train on a laptop CPU in a minute, and shaped like the real thing so
the rest of the system (rollout engine, log-probs, checkpoints) is exercised honestly.

Padding convention: prompts are left-padded, completions right-padded. `key_valid`
marks real tokens; pads are never attended to. Because RoPE encodes only relative
positions, left padding does not change what a row computes.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from .attention import cache_mask, rotate


@dataclass
class GPTConfig:
    vocab_size: int
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    block_size: int = 256  # longest sequence (prompt + completion) the model handles
    rope_base: float = 10000.0

    def to_dict(self) -> dict:
        return asdict(self)


def _rms_norm(x: torch.Tensor) -> torch.Tensor:
    # Parameter-free RMSNorm (as in nanochat): one fewer thing to tune or decay.
    return F.rms_norm(x, (x.size(-1),))


def _per_head(table: torch.Tensor, value_fill: float, n_head: int) -> torch.Tensor:
    """(T, D) table -> (3H, T, D): the table for query and key heads, a constant for value heads."""
    return torch.cat([table[None].expand(2 * n_head, -1, -1),
                      torch.full_like(table, value_fill)[None].expand(n_head, -1, -1)])


class KVCache:
    """Preallocated keys and values for every layer, filled left to right.

    `kv[layer]` is (B, 2H, T_max, D): keys in heads [0, H), values in [H, 2H), so one copy
    writes both. `key_valid` (B, T_max) marks which cached positions are real tokens.
    `count` (B,) set (the server's continuous batching, rollout/kv_cache.py): each row's positions are
    its count of real tokens so far, not the cache column, so a row may move to other columns.
    """

    def __init__(self, n_layer: int, batch: int, n_head: int, max_len: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        self.kv = torch.zeros((n_layer, batch, 2 * n_head, max_len, head_dim), dtype=dtype, device=device)
        self.key_valid = torch.zeros(batch, max_len, dtype=torch.bool, device=device)
        self.pos = 0
        self.max_len = max_len
        self.count: torch.Tensor | None = None

    def repeat_interleave(self, n: int) -> "KVCache":
        """Copy each row n times (prompt prefilled once, then shared by its n samples)."""
        out = KVCache.__new__(KVCache)
        out.kv = self.kv.repeat_interleave(n, dim=1)
        out.key_valid = self.key_valid.repeat_interleave(n, dim=0)
        out.pos, out.max_len = self.pos, self.max_len
        out.count = None if self.count is None else self.count.repeat_interleave(n)
        return out

    def select(self, rows: torch.Tensor) -> "KVCache":
        """The cache of `rows` (indices, e.g. the rows still decoding), same columns."""
        out = KVCache.__new__(KVCache)
        out.kv, out.key_valid = self.kv[:, rows], self.key_valid[rows]
        out.pos, out.max_len = self.pos, self.max_len
        out.count = None if self.count is None else self.count[rows]
        return out


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=False)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=False)
        self.fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=False)
        self.fc_out = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=False)

    def forward(self, x, cos, sin, mask, cache: KVCache | None, layer: int):
        B, T, C = x.shape
        H = self.n_head
        # (B, 3H, T, D): heads [0, H) queries, [H, 2H) keys, [2H, 3H) values; cos/sin leave values as they are
        qkv = rotate(self.qkv(_rms_norm(x)).view(B, T, 3 * H, C // H).transpose(1, 2), cos, sin)
        q, kv = qkv[:, :H], qkv[:, H:]
        if cache is not None:
            p = cache.pos
            cache.kv[layer, :, :, p:p + T] = kv
            kv = cache.kv[layer, :, :, :p + T]
        y = F.scaled_dot_product_attention(q, kv[:, :H], kv[:, H:], attn_mask=mask)
        # residual adds inside the matmuls (addmm): one op instead of two; a LoRA-wrapped projection
        # (model.lora_rank) is called as a module so that its adapter counts
        x = _residual(x.view(B * T, C), y.transpose(1, 2).reshape(B * T, C), self.proj)
        h = F.gelu(self.fc(_rms_norm(x)))
        return _residual(x, h, self.fc_out).view(B, T, C)


def _residual(x: torch.Tensor, h: torch.Tensor, linear: nn.Module) -> torch.Tensor:
    """x + linear(h), as one addmm for a plain bias-free nn.Linear."""
    if type(linear) is nn.Linear:
        return torch.addmm(x, h, linear.weight.t())
    return x + linear(h)


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.config = cfg
        self.gradient_checkpointing = False
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        hd = cfg.n_embd // cfg.n_head
        inv_freq = 1.0 / (cfg.rope_base ** (torch.arange(0, hd, 2).float() / hd))
        angles = torch.outer(torch.arange(cfg.block_size).float(), inv_freq)
        cos, sin = angles.cos(), angles.sin()
        # per head: [cos, cos] and [-sin, sin] (see attention.rotate) for queries and keys, identity for values
        qk_cos, qk_sin = torch.cat([cos, cos], -1), torch.cat([-sin, sin], -1)
        self.register_buffer("cos", _per_head(qk_cos, 1.0, cfg.n_head), persistent=False)   # (3H, block_size, D)
        self.register_buffer("sin", _per_head(qk_sin, 0.0, cfg.n_head), persistent=False)
        self.apply(self._init)
        for b in self.blocks:  # residual projections start small so depth does not blow up activations
            nn.init.normal_(b.proj.weight, std=0.02 / math.sqrt(2 * cfg.n_layer))
            nn.init.normal_(b.fc_out.weight, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)

    def new_cache(self, batch: int, max_len: int) -> KVCache:
        c = self.config
        p = self.lm_head.weight
        return KVCache(c.n_layer, batch, c.n_head, max_len, c.n_embd // c.n_head, p.dtype, p.device)

    def forward(self, idx: torch.Tensor, key_valid: torch.Tensor | None = None,
                cache: KVCache | None = None, logits_to_keep: int = 0, hidden: bool = False,
                segments: torch.Tensor | None = None) -> torch.Tensor:
        """Logits (B, T, V) for token ids (B, T); only the last `logits_to_keep` positions when > 0.
        With `hidden`, the normed hidden states (B, T, n_embd) that `head` turns into logits.

        key_valid: (B, T) bool, False at padding. With `cache`, idx holds the next T
        tokens after `cache.pos`; their validity is recorded in the cache.
        segments: (B, T) ints, packed sequences (SFT packing): a token attends only to earlier tokens
        of its own segment. RoPE scores depend on relative positions only, so a packed example gets
        the logits it would get alone.
        """
        B, T = idx.shape
        start = cache.pos if cache is not None else 0
        end = start + T
        per_row = cache is not None and cache.count is not None
        if end > self.config.block_size and not per_row:
            raise ValueError(f"sequence of {end} tokens exceeds model.block_size={self.config.block_size}")
        decode = cache is not None and T == 1 and key_valid is None
        if key_valid is None:
            key_valid = torch.ones(B, T, dtype=torch.bool, device=idx.device)
        if cache is not None:
            cache.key_valid[:, start:end] = key_valid
            keys = cache.key_valid[:, :end]
        else:
            keys = key_valid
        mask = cache_mask(keys, start, end, decode)
        if segments is not None:
            mask = mask & (segments[:, None, :, None] == segments[:, None, None, :])
        if per_row:   # positions from each row's real-token count; (B, 3H, T, D) tables
            pos = cache.count[:, None] + key_valid.long().cumsum(-1) - 1
            if int(pos.max()) >= self.config.block_size:
                raise ValueError(f"a row reaches position {int(pos.max())}, "
                                 f"beyond model.block_size={self.config.block_size}")
            pos = pos.clamp(min=0)
            cache.count = cache.count + key_valid.sum(-1)
            cos, sin = self.cos[:, pos].transpose(0, 1), self.sin[:, pos].transpose(0, 1)
        else:
            cos, sin = self.cos[:, start:end], self.sin[:, start:end]
        x = self.wte(idx)
        # activation checkpointing (model.gradient_checkpointing): keep only each block's input for the
        # backward and recompute the block there
        ckpt = self.gradient_checkpointing and self.training and torch.is_grad_enabled() and cache is None
        for i, block in enumerate(self.blocks):
            x = checkpoint(block, x, cos, sin, mask, None, i, use_reentrant=False) if ckpt else \
                block(x, cos, sin, mask, cache, i)
        if cache is not None:
            cache.pos = end
        if logits_to_keep:
            x = x[:, -logits_to_keep:]
        x = _rms_norm(x)
        return x if hidden else self.lm_head(x)

    def head(self, h: torch.Tensor) -> torch.Tensor:
        """Logits from `forward(..., hidden=True)`'s output (the final norm is already applied)."""
        return self.lm_head(h)

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())
