"""The weights a slotted decode (models/slot_forward.py) computes with, in one layout for every model it
supports: Hugging Face Llama-family models (llama, mistral, qwen2, qwen3) and the built-in GPT.

Each layer's query/key/value projections are fused into one matrix and the MLP's gate and up
projections into another (LoRA adapters merged in, as `lean_decode.linear_weights` adds them). The
tensors are copies owned here, allocated once: `refresh` copies the policy's current weights into
them before each rollout, so a CUDA graph captured over them stays valid after every optimizer step.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
import torch.nn as nn

from .gpt import GPT
from .lean_decode import (
    ATTN_LINEARS,
    MLP_LINEARS,
    is_lora,
    linear_weights,
    lora_reason,
    norm_eps,
    unsupported_reason,
    unwrap,
)


@dataclass
class LayerWeights:
    norm1: torch.Tensor | None      # RMSNorm weight before attention (None: parameter-free)
    qkv: torch.Tensor               # (H*D + 2*KV*D, C)
    qkv_b: torch.Tensor | None
    q_norm: torch.Tensor | None     # Qwen3's per-head norms on queries and keys, before the rotation
    k_norm: torch.Tensor | None
    o: torch.Tensor                 # (C, H*D)
    o_b: torch.Tensor | None
    norm2: torch.Tensor | None
    up: torch.Tensor                # gate and up fused (2I, C) for a gated MLP; fc (4C, C) for the GPT's
    up_b: torch.Tensor | None
    down: torch.Tensor
    down_b: torch.Tensor | None


@dataclass
class DecodeWeights:
    embed: torch.Tensor             # (V, C)
    layers: list[LayerWeights]
    norm: torch.Tensor | None       # the final RMSNorm's weight
    head: torch.Tensor              # (V, C)
    head_b: torch.Tensor | None
    n_head: int
    n_kv: int
    head_dim: int
    scale: float                    # attention's softmax scale
    eps: float | None               # RMSNorm epsilon (None: F.rms_norm's default)
    upcast: bool                    # RMSNorm in float32, cast back (Hugging Face's); else in the model's dtype
    gated: bool                     # silu(gate) * up (Llama family); else gelu(fc)
    cos: torch.Tensor               # (max_positions, D) rotary tables, rotate-half sign folded into sin
    sin: torch.Tensor
    sources: object = None          # () -> the same structure from the policy's current weights (refresh)

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.dtype

    @property
    def device(self) -> torch.device:
        return self.embed.device

    @property
    def max_positions(self) -> int:
        return self.cos.size(0)

    def tensors(self) -> list[torch.Tensor | None]:
        """Every weight tensor, in a fixed order (what `refresh` copies)."""
        out = [self.embed, self.norm, self.head, self.head_b]
        for L in self.layers:
            out += [L.norm1, L.qkv, L.qkv_b, L.q_norm, L.k_norm, L.o, L.o_b, L.norm2, L.up, L.up_b, L.down, L.down_b]
        return out

    @torch.no_grad()
    def refresh(self) -> None:
        """Copy the policy's current weights into these tensors (their storage stays where it is)."""
        for mine, now in zip(self.tensors(), self.sources().tensors()):
            if mine is not None:
                mine.copy_(now)


def _cat(parts: list[torch.Tensor | None], like: list[torch.Tensor]) -> torch.Tensor | None:
    """Biases fused like their weights: None when none has one, zeros for the ones missing."""
    if all(p is None for p in parts):
        return None
    return torch.cat([p if p is not None else w.new_zeros(w.size(0)) for p, w in zip(parts, like)])


def _rope_tables(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(positions, D) cos and sin in the halves layout, with rotate_half's sign folded into sin."""
    half = cos.size(-1) // 2
    sign = torch.cat([-torch.ones(half), torch.ones(half)]).to(sin)
    return cos.contiguous(), (sin * sign).contiguous()


def unsupported(model: nn.Module, max_len: int) -> str | None:
    """Why the slotted decode cannot run `model` for sequences of `max_len` tokens, or None."""
    if isinstance(model, GPT):
        for b in model.blocks:
            for m in (b.qkv, b.proj, b.fc, b.fc_out):
                if is_lora(m):
                    if (why := lora_reason(m)) is not None:
                        return why
                elif type(m) is not nn.Linear:
                    return "the built-in GPT's layers are not plain nn.Linear"
        return None
    hf = getattr(model, "hf", None)
    if hf is None:
        return f"{type(model).__name__} is neither the built-in GPT nor a Hugging Face policy"
    return unsupported_reason(hf, max_len)


def _gpt_weights(model: GPT) -> DecodeWeights:
    c = model.config
    layers = []
    for b in model.blocks:
        (qkv, qkv_b), (o, o_b) = linear_weights(b.qkv), linear_weights(b.proj)
        (up, up_b), (down, down_b) = linear_weights(b.fc), linear_weights(b.fc_out)
        layers.append(LayerWeights(None, qkv, qkv_b, None, None, o, o_b, None, up, up_b, down, down_b))
    head, head_b = linear_weights(model.lm_head)
    # the model's own tables: (3H, block_size, D) per head; every query/key head holds the same rows
    cos, sin = model.cos[0], model.sin[0]
    return DecodeWeights(model.wte.weight, layers, None, head, head_b, c.n_head, c.n_head, c.n_embd // c.n_head,
                         (c.n_embd // c.n_head) ** -0.5, None, False, False, cos.contiguous(), sin.contiguous())


def _hf_weights(hf_model, max_positions: int) -> DecodeWeights:
    lm = unwrap(hf_model)
    cfg, inner = lm.config, lm.model
    layers = []
    for layer in inner.layers:
        a, m = layer.self_attn, layer.mlp
        (qw, qb), (kw, kb), (vw, vb), (ow, ob) = (linear_weights(getattr(a, n)) for n in ATTN_LINEARS)
        (gw, gb), (uw, ub), (dw, db) = (linear_weights(getattr(m, n)) for n in MLP_LINEARS)
        qn, kn = getattr(a, "q_norm", None), getattr(a, "k_norm", None)
        layers.append(LayerWeights(
            layer.input_layernorm.weight, torch.cat([qw, kw, vw]), _cat([qb, kb, vb], [qw, kw, vw]),
            None if qn is None else qn.weight, None if kn is None else kn.weight, ow, ob,
            layer.post_attention_layernorm.weight, torch.cat([gw, uw]), _cat([gb, ub], [gw, uw]), dw, db))
    a = inner.layers[0].self_attn
    emb = inner.embed_tokens.weight
    with torch.no_grad():
        cos, sin = inner.rotary_emb(emb[:1][None], torch.arange(max_positions, device=emb.device)[None])
    cos, sin = _rope_tables(cos[0], sin[0])
    return DecodeWeights(emb, layers, inner.norm.weight, lm.lm_head.weight, lm.lm_head.bias,
                         cfg.num_attention_heads, cfg.num_key_value_heads, a.head_dim, a.scaling,
                         norm_eps(inner.norm), True, True, cos, sin)


def _current(model: nn.Module, max_positions: int) -> DecodeWeights:
    """The policy's weights as they are now (views of its parameters where nothing is fused)."""
    if isinstance(model, GPT):
        return _gpt_weights(model)
    return _hf_weights(model.hf, max_positions)


@torch.no_grad()
def decode_weights(model: nn.Module, max_positions: int) -> DecodeWeights:
    """Owned copies of `model`'s weights in the slotted decode's layout, with rotary tables for
    `max_positions` positions (the built-in GPT's own block_size), and a `refresh` that re-copies them."""
    now = _current(model, max_positions)
    owned = [None if t is None else t.detach().clone() for t in now.tensors()]
    it = iter(owned)
    embed, norm, head, head_b = next(it), next(it), next(it), next(it)
    layers = [LayerWeights(*(next(it) for _ in range(12))) for _ in now.layers]
    out = DecodeWeights(embed, layers, norm, head, head_b, now.n_head, now.n_kv, now.head_dim, now.scale, now.eps,
                        now.upcast, now.gated, now.cos, now.sin)
    policy = weakref.ref(model)   # not a strong one: decoders are cached per model, weakly (slot_decode.py)
    out.sources = lambda: _current(policy(), max_positions)
    return out
