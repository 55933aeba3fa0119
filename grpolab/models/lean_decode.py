"""A lean sampling path for Llama-family Hugging Face models (llama, mistral, qwen2, qwen3).

Sampling calls the model once per generated token. The HF forward is general (cache
objects, mask builders, output classes, hooks) and on small decode batches that per-call
machinery costs more than the matmuls. `LeanDecoder` runs the same math directly on the
HF module's own parameters with a preallocated KV cache, fused QKV and gate/up
projections (concatenated once per rollout, so they always match the current weights)
with each RMSNorm's weight folded in and its row scale applied after the matmul, an
additive attention mask kept in the cache (a decode step reads it, builds nothing) and
per-row positions read from a precomputed RoPE table. Training keeps the HF forward;
tests check both agree (logits, and greedy tokens equal to `generate`).

peft LoRA adapters are merged into those fused weights (W + scale * B @ A, once per rollout, so
sampling costs what the base model's does); the trainer's forward keeps them separate, which
agrees to float rounding. Anything outside the supported shape (other architectures, sliding
windows shorter than the rollout, other adapter kinds, active LoRA dropout) returns a reason from
`unsupported_reason` and the policy falls back to the HF forward.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from .attention import cache_mask, rotate
from .row_attention import attend_runs, runs

SUPPORTED = ("llama", "mistral", "qwen2", "qwen3")
ATTN_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_LINEARS = ("gate_proj", "up_proj", "down_proj")


def unwrap(hf_model):
    """The transformers model inside a peft wrapper (PeftModel.get_base_model), else the model itself."""
    get = getattr(hf_model, "get_base_model", None)
    return get() if callable(get) else hf_model


def is_lora(m: nn.Module) -> bool:
    """A peft LoRA linear (peft.tuners.lora.Linear), recognised by its interface so that this module
    does not import peft."""
    return all(hasattr(m, a) for a in ("base_layer", "lora_A", "lora_B", "get_delta_weight", "active_adapters"))


def lora_reason(m: nn.Module) -> str | None:
    if type(m.base_layer) is not nn.Linear:
        return "a LoRA adapter wraps a layer that is not a plain nn.Linear"
    if getattr(m, "lora_variant", None) or any(getattr(m, "use_dora", {}).values()):
        return "LoRA variants (DoRA, ...) are not merged by the lean path"
    if any(m.training and not isinstance(d, nn.Identity) for d in m.lora_dropout.values()):
        return "LoRA dropout is active (training mode)"
    return None


def linear_weights(m: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The (weight, bias) that `m` applies: an nn.Linear's own, or a peft LoRA linear's base weight
    plus the delta of each active adapter, as peft's forward adds them (none when the adapters are
    disabled; already in the base weight when merged)."""
    if not is_lora(m):
        return m.weight, m.bias
    base = m.base_layer
    w = base.weight
    if not m.disable_adapters and not m.merged:
        for name in m.active_adapters:
            if name in m.lora_A:
                w = w + m.get_delta_weight(name)
    return w, base.bias


def unsupported_reason(hf_model, max_len: int) -> str | None:
    """Why the lean path cannot run this model for sequences of `max_len` tokens, or None."""
    hf_model = unwrap(hf_model)
    cfg = hf_model.config
    if cfg.model_type not in SUPPORTED:
        return f"model_type {cfg.model_type!r} is not one of {SUPPORTED}"
    if getattr(cfg, "hidden_act", "silu") != "silu":
        return f"hidden_act {cfg.hidden_act!r}"
    if getattr(cfg, "pretraining_tp", 1) != 1:
        return "pretraining_tp > 1"
    window = getattr(cfg, "sliding_window", None)
    types = getattr(cfg, "layer_types", None) or []
    windowed = any(t != "full_attention" for t in types) or (cfg.model_type == "mistral" and not types)
    if window and windowed and max_len > window:
        return f"sliding window {window} shorter than {max_len} tokens"
    inner = getattr(hf_model, "model", None)
    if inner is None or not hasattr(inner, "layers") or not hasattr(hf_model, "lm_head"):
        return "unexpected module layout"
    for layer in inner.layers:
        mods = [getattr(layer.self_attn, n, None) for n in ATTN_LINEARS] + [
            getattr(layer.mlp, n, None) for n in MLP_LINEARS]
        for m in mods:
            if is_lora(m):
                if (why := lora_reason(m)) is not None:
                    return why
            elif type(m) is not nn.Linear:   # e.g. quantized linears
                return "attention/MLP projections are not plain nn.Linear"
    if is_lora(inner.embed_tokens):
        return "a LoRA adapter on the embeddings"
    if type(hf_model.lm_head) is not nn.Linear:
        return "lm_head is not a plain nn.Linear"
    return None


def _prepacks(w: torch.Tensor) -> bool:
    """Whether `w` goes through oneDNN prepacked: float32 weights on a CPU whose torch has oneDNN."""
    return w.device.type == "cpu" and w.dtype == torch.float32 and torch.backends.mkldnn.is_available()


class _Linear:
    """x @ W.T (+ b), with W (N, K) reordered once, when the decoder is built, into oneDNN's blocked
    layout on a CPU in float32. At decode shapes (32 rows x SmolLM2's widths, one thread) that ran
    2.1-2.8x faster than torch.mm with W as it is, and 2.4x at a 600-row prefill; each row's result
    is the same whatever the other rows (checked at 1 to 600 rows, 1 and 2 threads), so completions
    still do not depend on the batch. Other dtypes and devices: F.linear."""

    def __init__(self, w: torch.Tensor, b: torch.Tensor | None) -> None:
        self.b = b
        self.packed = _prepacks(w)
        self.w = torch.ops.mkldnn._reorder_linear_weight(w.contiguous()) if self.packed else w

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed:
            return torch.ops.mkldnn._linear_pointwise(x, self.w, self.b, "none", [], "")
        return F.linear(x, self.w, self.b)

    def residual(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """x + y @ W.T (+ b), the residual add inside the matmul (one op, not two)."""
        if self.packed:
            return torch.ops.mkldnn._linear_pointwise.binary(y, x, self.w, self.b, "add")
        out = torch.addmm(x, y, self.w.t())
        return out if self.b is None else out.add_(self.b)


class _NormedLinear:
    """rms_norm(x) @ (W * w).T + b: an HF RMSNorm (weight w) followed by a linear map (W, b),
    with w folded into W's columns (norm(x) * w @ W.T == norm(x) @ (W * w).T).

    The norm's row scale r = 1/sqrt(mean(x^2) + eps) commutes with the matmul, so in float32
    it is applied to the output: one fused reduction (`vector_norm`) and two tiny ops on (B, 1)
    instead of the composite rms_norm's five passes over x, which dominate small decode batches.
    Other dtypes normalise in float32 first, as HF does.
    """

    def __init__(self, norm: nn.Module, w: torch.Tensor, b: torch.Tensor | None) -> None:
        self.linear = _Linear(w * norm.weight, None)
        self.b = b
        self.eps = norm_eps(norm)
        self.eps_t = torch.full((1,), self.eps, dtype=torch.float32, device=w.device)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float32:   # (then never prepacked)
            return F.linear(_rms(x, self.eps), self.linear.w, self.b)
        n = torch.linalg.vector_norm(x, dim=-1, keepdim=True)
        r = torch.addcmul(self.eps_t, n, n, value=1.0 / x.size(-1)).rsqrt_()
        out = self.linear(x)
        return out.mul_(r) if self.b is None else torch.addcmul(self.b, out, r)


class _Layer:
    """One decoder layer's weights for this rollout: QKV and gate/up fused, each with the
    RMSNorm before it folded in."""

    def __init__(self, layer) -> None:
        a, m = layer.self_attn, layer.mlp
        (qw, qb), (kw, kb), (vw, vb), (ow, ob) = (linear_weights(getattr(a, n)) for n in ATTN_LINEARS)
        (gw, gb), (uw, ub), (dw, db) = (linear_weights(getattr(m, n)) for n in MLP_LINEARS)
        qkv_b = None if qb is None and kb is None and vb is None else torch.cat(
            [b if b is not None else w.new_zeros(w.size(0)) for b, w in ((qb, qw), (kb, kw), (vb, vw))])
        self.qkv = _NormedLinear(layer.input_layernorm, torch.cat([qw, kw, vw]), qkv_b)
        self.o = _Linear(ow, ob)
        self.gate_up = _NormedLinear(layer.post_attention_layernorm, torch.cat([gw, uw]),
                                     None if gb is None else torch.cat([gb, ub]))
        self.down = _Linear(dw, db)
        self.q_norm, self.k_norm = getattr(a, "q_norm", None), getattr(a, "k_norm", None)
        self.scaling = a.scaling


def norm_eps(norm: nn.Module) -> float:
    return getattr(norm, "variance_epsilon", None) or getattr(norm, "eps", 1e-6)


def _rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    # HF RMSNorm normalises in float32 and casts back (its weight is folded into the next matmul here)
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.size(-1),), eps=eps)
    return F.rms_norm(x.float(), (x.size(-1),), eps=eps).to(x.dtype)


def hf_norm(x: torch.Tensor, norm: nn.Module) -> torch.Tensor:
    """An HF RMSNorm module applied as HF does."""
    return norm.weight * _rms(x, norm_eps(norm))


# share_prompt(): keep one copy of a group's prompt keys and values when that saves at least this
# many bytes per layer. Measured (docs/benchmarks.md): the two-part attention is faster at 64 rows x 128
# prompt tokens x 512 wide (28 MiB per layer saved) and at SmolLM2's 4 prompts x 8 rows x 153 tokens (6.3 MiB,
# bench/row_attention.py); at the tiny bench's 16 prompts x 4 rows x 22 tokens x 128 wide (1 MiB) the per-row
# copy wins, the prompt being cache-resident anyway.
SHARE_MIN_BYTES = 4 * 2**20


class _Prefix:
    """A shared prompt: each group's prompt keys/values once, for the G rows decoding from it."""

    def __init__(self, kv: torch.Tensor, bias: torch.Tensor, group: int, slots: torch.Tensor | None) -> None:
        self.kv = kv          # (layers, groups, 2KV, prompt_len, D)
        self.bias = bias      # (groups, 1, 1, prompt_len) additive mask: 0 real, -inf padding
        self.group = group    # G rows per group
        self.slots = slots    # (B,) each row's index in groups x G; None: row r is slot r (all rows present)

    def of_rows(self, rows: torch.Tensor) -> "_Prefix":
        """The prefix of a batch made of `rows` (indices into this batch, in their new order); groups with
        no row left are dropped."""
        G = self.group
        slots = rows if self.slots is None else self.slots[rows]
        groups = slots // G
        alive = torch.unique(groups)   # sorted
        kv, bias = self.kv, self.bias
        if alive.numel() < kv.size(1):
            kv, bias = kv[:, alive], bias[alive]
            slots = torch.searchsorted(alive, groups) * G + slots % G
        whole = slots.numel() == kv.size(1) * G and bool((slots == torch.arange(slots.numel())).all())
        return _Prefix(kv, bias, G, None if whole else slots)


def store_rows(rows: int, capacity: int) -> int:
    """Rows a store for `rows` makes room for: twice as many, up to `capacity` (a long context's store is
    not `capacity` rows up front)."""
    return max(rows, min(capacity, 2 * rows))


class _Store:
    """A LeanCache's tensors, of which a batch uses the first rows: rows leave by moving the last rows into
    their places, and join (the server) by a copy of their own rows into free ones, instead of copying
    every row into new tensors."""

    def __init__(self, kv: torch.Tensor, bias: torch.Tensor, count: torch.Tensor) -> None:
        self.kv, self.bias, self.count = kv, bias, count

    @classmethod
    def room(cls, like: "LeanCache", capacity: int) -> "_Store":
        """Tensors shaped as `like`'s, with room for `capacity` rows; keys and values unwritten: every row is
        copied in whole before it is used (`extend`)."""
        kv = like.kv
        return cls(kv.new_empty((kv.size(0), capacity, *kv.shape[2:])),
                   like.bias.new_full((capacity, like.bias.size(1)), float("-inf")), like.count.new_zeros(capacity))

    def rows(self, n: int, like: "LeanCache") -> "LeanCache":
        """A LeanCache over the first `n` rows (views: the decoder writes into the store), at `like`'s write
        column, with `like`'s prefix."""
        out = like._like(self.kv[:, :n], self.bias[:n], self.count[:n], like.prefix)
        out.store = self
        return out


class LeanCache:
    """Preallocated K/V for every layer (keys in heads [0, KV), values in [KV, 2KV) so one copy
    writes both), the fused weights of this rollout, and per-row positions.

    After `share_prompt(G)` the prompt's keys and values are kept once per group (`prefix`) and `kv`
    holds the completions only; a decode step attends to both and merges the two softmaxes.
    `store`: when set, kv, bias and count are the first rows of its tensors (`compact`, `extend`)."""

    def __init__(self, decoder: "LeanDecoder", batch: int, max_len: int, zero: bool = True) -> None:
        d = decoder
        # zero=False: keys and values unwritten, for a cache whose every column is written (by all its rows)
        # before a step reads it; padding a step reads must be finite (0 x NaN would poison the attention)
        shape = (d.n_layer, batch, 2 * d.n_kv, max_len, d.head_dim)
        self.kv = (torch.zeros if zero else torch.empty)(shape, dtype=d.dtype, device=d.device)
        # which cached positions are real tokens, as an additive attention mask (0 real, -inf
        # padding or not yet written): a decode step reads its mask instead of building one
        self.bias = torch.full((batch, max_len), float("-inf"), dtype=d.dtype, device=d.device)
        self.count = torch.zeros(batch, dtype=torch.long, device=d.device)  # real tokens seen per row
        self.pos, self.max_len, self.decoder = 0, max_len, decoder
        self.prefix: _Prefix | None = None
        self.store: _Store | None = None

    def _like(self, kv: torch.Tensor, bias: torch.Tensor, count: torch.Tensor, prefix: _Prefix | None) -> "LeanCache":
        out = LeanCache.__new__(LeanCache)
        out.kv, out.bias, out.count, out.prefix, out.store = kv, bias, count, prefix, None
        out.pos, out.max_len, out.decoder = self.pos, self.max_len, self.decoder
        return out

    def fill(self, kvs: list[torch.Tensor]) -> None:
        """Row r gets prompt r's keys and values `kvs[r]` (layers, 2 KV, length, D), all prompts ending at the
        longest's last column (left padding), as a prefill writes them; the next token goes after it."""
        width = max(kv.size(2) for kv in kvs)
        for r, kv in enumerate(kvs):
            self.kv[:, r, :, width - kv.size(2):width] = kv
            self.bias[r, width - kv.size(2):width] = 0.0
        self.count = torch.tensor([kv.size(2) for kv in kvs], device=self.count.device)
        self.pos = width

    def repeat_interleave(self, n: int) -> "LeanCache":
        """Each row n times (a prompt prefilled once, shared by its n samples)."""
        return self._like(self.kv.repeat_interleave(n, dim=1), self.bias.repeat_interleave(n, dim=0),
                          self.count.repeat_interleave(n, dim=0), None)

    def share_prompt(self, n: int) -> "LeanCache":
        """Each row n times for decoding, like `repeat_interleave`, but where it pays (a CPU decode,
        >= SHARE_MIN_BYTES of prompt keys and values saved per layer) the prompts' keys and values
        stay one copy per prompt and only the completions get per-row columns."""
        d, L = self.decoder, self.pos
        saved = (n - 1) * self.kv.size(1) * self.kv.size(2) * L * d.head_dim * self.kv.element_size()
        if n < 2 or self.kv.device.type != "cpu" or saved < SHARE_MIN_BYTES or self.prefix is not None:
            return self.repeat_interleave(n)
        B = self.kv.size(1) * n
        # completion columns only, each written by every row's decode step before any step reads it (untouched
        # pages of rows that finish early are never faulted in)
        out = LeanCache(d, B, self.max_len - L, zero=False)
        out.prefix = _Prefix(self.kv[:, :, :, :L].contiguous(), self.bias[:, None, None, :L].contiguous(), n, None)
        out.count = self.count.repeat_interleave(n, dim=0)
        return out

    def select(self, rows: torch.Tensor) -> "LeanCache":
        """The cache of `rows` (indices, e.g. the rows still decoding), same columns, in new tensors."""
        return self._like(self.kv[:, rows], self.bias[rows], self.count[rows],
                          None if self.prefix is None else self.prefix.of_rows(rows))

    def place(self, pos: int, cols: int, room: int = 0) -> "LeanCache":
        """The same rows in a frame of `cols` columns, their last min(pos, self.pos) columns ending at
        column `pos` (the server's frame moved or grown); with `room` rows (more than these), the first
        rows of a store that the rows joining next are copied into (`extend`), so the frame is made once.
        A store of `cols` columns and enough rows is reused: its rows move in place (`_shift`)."""
        k, n = min(self.pos, pos), self.kv.size(1)
        rows = max(n, room)
        if self.store is not None and cols == self.max_len and self.store.kv.size(1) >= rows and self.prefix is None:
            return self._shift(pos, k)
        # the rows beyond n are written whole when rows join (`extend`): left unwritten, their pages are
        # never touched until then (on this machine first touching memory is most of a join's time)
        kv = self.kv.new_empty((self.kv.size(0), rows, *self.kv.shape[2:3], cols, self.kv.size(-1)))
        kv[:, :n, :, :pos - k] = 0
        kv[:, :n, :, pos - k:pos] = self.kv[:, :, :, self.pos - k:self.pos]
        kv[:, :n, :, pos:] = 0
        bias = self.bias.new_full((rows, cols), float("-inf"))
        bias[:n, pos - k:pos] = self.bias[:, self.pos - k:self.pos]
        count = self.count if rows == n else torch.cat([self.count, self.count.new_zeros(rows - n)])
        out = self._like(kv, bias, count, self.prefix)
        out.pos, out.max_len = pos, cols
        return out if rows == n else _Store(kv, bias, count).rows(n, out)

    def _shift(self, pos: int, k: int) -> "LeanCache":
        """`place` within this cache's own store: every row's last k columns moved to end at `pos`, the columns
        before zeroed (padding a step reads must be finite); the columns from `pos` on are left as they are,
        since a decode step writes each before any step reads it. Fresh tensors would cost first touches of
        every page, most of a move's time on this machine."""
        if pos != self.pos:
            for layer in self.kv:   # a layer at a time: where the columns go overlaps where they were
                layer[:, :, pos - k:pos] = layer[:, :, self.pos - k:self.pos].clone()
            moved = self.bias[:, self.pos - k:self.pos].clone()
            self.bias.fill_(float("-inf"))
            self.bias[:, pos - k:pos] = moved
        self.kv[:, :, :, :pos - k] = 0
        out = self.store.rows(self.kv.size(1), self)
        out.pos = pos
        return out

    def compact(self, idx: torch.Tensor) -> tuple["LeanCache", torch.Tensor]:
        """The rows `idx` (increasing) in this cache's own tensors: each leaving row's place is taken by one
        of the last kept rows, so only those are copied. Returns the cache (this one is spent) and its
        rows' order, as indices into this batch: a row computes the same wherever it sits."""
        n = idx.numel()
        store = self.store if self.store is not None else _Store(self.kv, self.bias, self.count)
        order = torch.arange(n, device=idx.device)
        dst = (~torch.isin(order, idx)).nonzero().squeeze(1)   # leavers' places among the first n rows
        if dst.numel():
            src = idx[idx >= n]   # kept rows beyond the first n, as many as there are holes
            store.kv[:, dst], store.bias[dst], store.count[dst] = store.kv[:, src], store.bias[src], store.count[src]
            order[dst] = src
        out = store.rows(n, self)
        if self.prefix is not None:
            out.prefix = self.prefix.of_rows(order)
        return out, order

    def extend(self, other: "LeanCache", capacity: int) -> "LeanCache":
        """This cache's rows, then `other`'s (no shared prompts), in a store with room for twice the rows (up
        to `capacity`), so that later joins copy only their own rows. `other`'s columns (its write column at
        most this one's) are placed to end at this cache's write column, padding zeroed before them; the
        columns after are left unwritten (a decode step writes each before any step reads it)."""
        na, nb = self.kv.size(1), other.kv.size(1)
        pos, k = self.pos, other.pos
        if k > pos:
            raise ValueError(f"joining rows written up to column {k} to a frame written up to {pos}")
        a = self
        if a.store is None or a.store.kv.size(1) < na + nb:
            store = _Store.room(a, store_rows(na + nb, capacity))
            store.kv[:, :na], store.bias[:na], store.count[:na] = a.kv, a.bias, a.count
            a = store.rows(na, a)
        s = a.store
        s.kv[:, na:na + nb, :, :pos - k] = 0
        s.kv[:, na:na + nb, :, pos - k:pos] = other.kv[:, :, :, :k]
        s.bias[na:na + nb] = float("-inf")
        s.bias[na:na + nb, pos - k:pos] = other.bias[:, :k]
        s.count[na:na + nb] = other.count
        return s.rows(na + nb, a)


def _flash(q, k, v, mask, scale):
    """torch's CPU flash attention with its log-sum-exp: (out (B, h, T, D), lse (B, h, T))."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, False, attn_mask=mask,
                                                                      scale=scale)


def _attend_shared(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, pre: _Prefix,
                   layer: int, scale: float) -> torch.Tensor:
    """One decode token per row attending to its group's shared prompt and its own completion.

    q (B, H, 1, D); k, v (B, KV, t, D) the completion so far; mask (B, 1, 1, t). The query heads that
    share a key head are folded into the query axis (GQA), and each group's rows form one block of
    queries against the prompt's keys, read once per group instead of once per row. The two softmaxes
    merge by their log-sum-exps: softmax over [prompt | completion] = the parts' outputs weighted by
    exp(lse_part - lse_total).
    """
    B, H, _, D = q.shape
    KV = k.size(1)
    r = H // KV
    qf = q.reshape(B, KV, r, D)
    oc, lc = _flash(qf, k, v, mask, scale)
    G, n = pre.group, pre.kv.size(1)
    qs = qf if pre.slots is None else qf.new_zeros(n * G, KV, r, D).index_copy_(0, pre.slots, qf)
    qg = qs.view(n, G, KV, r, D).transpose(1, 2).reshape(n, KV, G * r, D)
    kv = pre.kv[layer]
    op, lp = _flash(qg, kv[:, :KV], kv[:, KV:], pre.bias, scale)
    op = op.reshape(n, KV, G, r, D).transpose(1, 2).reshape(n * G, KV, r, D)
    lp = lp.reshape(n, KV, G, r).transpose(1, 2).reshape(n * G, KV, r)
    if pre.slots is not None:
        op, lp = op[pre.slots], lp[pre.slots]
    m = torch.maximum(lp, lc)
    wp, wc = (lp - m).exp_().unsqueeze_(-1), (lc - m).exp_().unsqueeze_(-1)
    y = (op * wp).add_(oc * wc).div_(wp + wc)
    return y.view(B, H, 1, D)


class LeanDecoder:
    """The forward pass of a supported HF causal LM, for sampling with a `LeanCache`.

    Built at the start of a rollout (under `torch.inference_mode`), after the last weight update.
    """

    def __init__(self, hf_model, max_len: int) -> None:
        hf_model = unwrap(hf_model)
        cfg, inner = hf_model.config, hf_model.model
        self.embed_w = inner.embed_tokens.weight
        self.head = _NormedLinear(inner.norm, hf_model.lm_head.weight, hf_model.lm_head.bias)
        self.layers = [_Layer(layer) for layer in inner.layers]
        a = inner.layers[0].self_attn
        self.n_layer = len(self.layers)
        self.head_dim = a.head_dim
        self.n_head = cfg.num_attention_heads
        self.n_kv = cfg.num_key_value_heads
        self.dtype, self.device = self.embed_w.dtype, self.embed_w.device
        # cos/sin for positions 0..max_len-1 from the model's own rotary module (handles rope scaling).
        # rotate_half(x) == roll(x, D/2) * [-1]*D/2 + [1]*D/2, so the sign is folded into the sin table.
        positions = torch.arange(max_len, device=self.device)[None]
        cos, sin = inner.rotary_emb(self.embed_w[:1][None], positions)
        half = self.head_dim // 2
        sign = torch.cat([-torch.ones(half), torch.ones(half)]).to(sin)
        cos, sin = cos[0][:, None], (sin[0] * sign)[:, None]   # (max_len, 1, head_dim)
        self.fused_rope = self.layers[0].q_norm is None
        if self.fused_rope:
            # per head, for the whole fused QKV output: the rotation for query and key heads, the
            # identity (cos 1, sin 0) for value heads, so one pass rotates q and k and copies v
            qk, kv = self.n_head + self.n_kv, self.n_kv
            cos = torch.cat([cos.expand(-1, qk, -1), torch.ones_like(cos).expand(-1, kv, -1)], dim=1)
            sin = torch.cat([sin.expand(-1, qk, -1), torch.zeros_like(sin).expand(-1, kv, -1)], dim=1)
        # one table, one row lookup per position: (max_len, 2, heads or 1, head_dim), cos then sin
        self.rope = torch.stack([cos, sin], dim=1).contiguous()
        # a CPU decode step attends run by run of rows, over each run's own columns (row_attention.py);
        # elsewhere the cut would synchronise every step
        self.by_rows = self.device.type == "cpu"

    def _rope(self, pos: torch.Tensor, B: int, T: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin (B, heads or 1, T, D) at flat positions `pos` (B*T,)."""
        cs = self.rope.index_select(0, pos).view(B, T, *self.rope.shape[1:])
        return cs[:, :, 0].transpose(1, 2), cs[:, :, 1].transpose(1, 2)

    def new_cache(self, batch: int, max_len: int) -> LeanCache:
        return LeanCache(self, batch, max_len)

    def forward(self, idx: torch.Tensor, key_valid: torch.Tensor | None, cache: LeanCache,
                logits_to_keep: int = 0) -> torch.Tensor:
        B, T = idx.shape
        start, end = cache.pos, cache.pos + T
        if end > cache.max_len:
            raise ValueError(f"sequence of {end} tokens exceeds the cache of {cache.max_len}")
        if cache.prefix is not None and (T != 1 or key_valid is not None):
            raise RuntimeError("a shared-prompt LeanCache decodes one token per row at a time")
        # positions as HF computes them from the attention mask: the count of real tokens before
        parts = [(0, B, end)]   # runs of rows and the columns each attends over: all, unless cut below
        if key_valid is None and T == 1:   # decode: one real token per row
            cache.bias[:, start] = 0.0
            cos, sin = self._rope(cache.count, B, 1)
            cache.count += 1   # after the lookup
            mask = cache.bias[:, None, None, :end]
            if self.by_rows and cache.prefix is None:   # a row's real tokens are its last `count` columns
                parts = runs(cache.count.tolist())
        else:
            if key_valid is None:
                key_valid = torch.ones(B, T, dtype=torch.bool, device=idx.device)
            cache.bias[:, start:end].masked_fill_(key_valid, 0.0)
            pos = (cache.count[:, None] + key_valid.long().cumsum(-1) - 1).clamp(min=0)
            cos, sin = self._rope(pos.reshape(-1), B, T)
            cache.count += key_valid.sum(-1)
            mask = cache_mask(cache.bias[:, :end] == 0, start, end, False)
            # additive float mask, built once here rather than converted by every layer's attention
            mask = torch.zeros(mask.shape, dtype=self.dtype, device=idx.device).masked_fill_(~mask, float("-inf"))
        H, KV, D = self.n_head, self.n_kv, self.head_dim
        fused_rope = self.fused_rope
        x = F.embedding(idx, self.embed_w).view(B * T, -1)
        for i, L in enumerate(self.layers):
            qkv = L.qkv(x).view(B, T, H + 2 * KV, D).transpose(1, 2)
            if fused_rope:   # rotate q, k (and v by the identity) in one pass; then one copy writes k and v
                r = rotate(qkv, cos, sin)
                q = r[:, :H]
                cache.kv[i, :, :, start:end] = r[:, H:]
            else:            # per-head q/k norms (Qwen3) come before the rotation
                q, k = hf_norm(qkv[:, :H], L.q_norm), hf_norm(qkv[:, H:H + KV], L.k_norm)
                q = rotate(q, cos, sin)
                cache.kv[i, :, :KV, start:end] = rotate(k, cos, sin)
                cache.kv[i, :, KV:, start:end] = qkv[:, H + KV:]
            kv = cache.kv[i, :, :, :end]
            if cache.prefix is not None:
                y = _attend_shared(q, kv[:, :KV], kv[:, KV:], mask, cache.prefix, i, L.scaling)
            elif T == 1:
                y = attend_runs(q, kv[:, :KV], kv[:, KV:], mask, parts, L.scaling)
            else:
                y = F.scaled_dot_product_attention(q, kv[:, :KV], kv[:, KV:], attn_mask=mask, scale=L.scaling,
                                                   enable_gqa=KV != H)
            x = L.o.residual(x, y.transpose(1, 2).reshape(B * T, H * D))
            gate, up = L.gate_up(x).chunk(2, dim=-1)
            x = L.down.residual(x, F.silu(gate) * up)
        cache.pos = end
        x = x.view(B, T, -1)
        if logits_to_keep:
            x = x[:, -logits_to_keep:]
        return self.head(x.reshape(-1, x.size(-1))).view(*x.shape[:2], -1)
