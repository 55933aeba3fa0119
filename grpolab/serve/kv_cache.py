"""The KV cache of a continuously batched decode, where rows join and leave between steps.

All rows write their next token at one shared column, `pos`. A row's real tokens are the last
`count` columns before it (prompts are left-padded, then one token per step). Each row takes its
positions from its own count of real tokens, not from its column, so moving a row to other
columns, or to another row, does not change what it computes. Three operations keep the batch tight:
- `keep`: some rows (finished rows leave), by the caches' own `select(rows)` (a prompt's n samples are
  copies of one row too), or for the lean decoder's cache by moving the last rows into the leavers' places;
- `place`: the same rows in a frame with another write column and width (room for longer
  prompts, or dropping columns that no row uses any more);
- `join`: stack two frames of the same geometry (rows that just joined the batch); the lean decoder's
  cache keeps room for twice its rows (up to `max_batch`), so joining copies the new rows only.

Supported caches: the built-in GPT's `KVCache` (with `count` set), the lean HF decoder's
`LeanCache`, and HF's `DynamicCache` (through `HFCache`) when none of its layers slides.
"""

from __future__ import annotations

import torch

from ..models.gpt import KVCache
from ..models.hf import HFCache
from ..models.lean_decode import LeanCache


def new_cache(model, batch: int, width: int, decoder=None):
    """An empty cache of `batch` rows and `width` columns with per-row positions. `decoder`: a
    `LeanDecoder` built once for the server (an HF model's fused weights), else the model's own."""
    if decoder is not None:
        return decoder.new_cache(batch, width)
    cache = model.new_cache(batch, width)
    if isinstance(cache, KVCache):
        cache.count = torch.zeros(batch, dtype=torch.long, device=cache.kv.device)
    elif isinstance(cache, LeanCache):   # model.new_cache built a decoder: the server passes its own
        raise ValueError("pass the server's LeanDecoder as `decoder`")
    return cache


def write_pos(cache) -> int:
    """The column the next token is written at."""
    if isinstance(cache, HFCache):
        return 0 if cache.mask is None else cache.mask.size(1)
    return cache.pos


def width(cache) -> int | None:
    """Columns allocated (None: HF's cache grows as it goes)."""
    return None if isinstance(cache, HFCache) else cache.max_len


def _layers(cache: HFCache) -> list:
    from transformers.cache_utils import DynamicLayer
    layers = cache.past.layers
    if any(type(layer) is not DynamicLayer for layer in layers):
        raise ValueError("continuous batching needs a model without sliding-window or other special cache "
                         "layers (or one the lean decode path supports: llama, mistral, qwen2, qwen3)")
    return layers


def place(cache, pos: int, cols: int | None):
    """The same rows with their last min(pos, old pos) columns moved to end at column `pos`, in a frame
    of `cols` columns (ignored for HF's growing cache). The caller keeps every row's real tokens:
    pos >= the largest count."""
    old = write_pos(cache)
    k = min(old, pos)
    if isinstance(cache, HFCache):
        for layer in _layers(cache):
            for name in ("keys", "values"):
                t = getattr(layer, name)
                new = t.new_zeros((*t.shape[:2], pos, t.size(-1)))
                new[:, :, pos - k:] = t[:, :, old - k:old]
                setattr(layer, name, new)
        mask = cache.mask.new_zeros((cache.mask.size(0), pos))
        mask[:, pos - k:] = cache.mask[:, old - k:old]
        cache.mask = mask
        return cache
    out = type(cache).__new__(type(cache))
    out.__dict__.update(cache.__dict__)
    kv = cache.kv
    out.kv = kv.new_zeros((*kv.shape[:3], cols, kv.size(-1)))
    out.kv[:, :, :, pos - k:pos] = kv[:, :, :, old - k:old]
    if isinstance(cache, KVCache):
        out.key_valid = cache.key_valid.new_zeros((cache.key_valid.size(0), cols))
        out.key_valid[:, pos - k:pos] = cache.key_valid[:, old - k:old]
    else:
        out.bias = cache.bias.new_full((cache.bias.size(0), cols), float("-inf"))
        out.bias[:, pos - k:pos] = cache.bias[:, old - k:old]
    out.pos, out.max_len = pos, cols
    return out


def _rows(frame: "_Frame", n: int, like: LeanCache) -> LeanCache:
    """A LeanCache over the first `n` rows of `frame` (views: the decoder writes into the frame), at
    `like`'s write column."""
    out = LeanCache.__new__(LeanCache)
    out.kv, out.bias, out.count = frame.kv[:, :n], frame.bias[:n], frame.count[:n]
    out.pos, out.max_len, out.decoder, out.prefix = like.pos, like.max_len, like.decoder, None
    out.frame = frame
    return out


class _Frame:
    """A LeanCache's tensors with room for `capacity` rows, of which a batch uses the first ones: rows
    join by a copy of their own columns into the free rows, and leave by moving the last rows into
    their places, instead of copying every row into new tensors."""

    def __init__(self, like: LeanCache, capacity: int) -> None:
        kv = like.kv
        self.kv = kv.new_zeros((kv.size(0), capacity, *kv.shape[2:]))
        self.bias = like.bias.new_full((capacity, like.bias.size(1)), float("-inf"))
        self.count = like.count.new_zeros(capacity)


def _framed(cache) -> bool:
    """Whether `cache` is rows of a frame (and not a copy made since, e.g. by `place`)."""
    frame = getattr(cache, "frame", None)
    return frame is not None and cache.kv.data_ptr() == frame.kv.data_ptr() and cache.kv.shape[2:] == frame.kv.shape[2:]


def keep(cache, idx: list[int]):
    """The rows `idx` (indices, increasing) of a batch's cache, and the order they are in: `idx` itself,
    or for a framed LeanCache the kept rows where they were, each leaving row's place taken by one of the
    last kept rows (only those are copied)."""
    if not (isinstance(cache, LeanCache) and _framed(cache)):
        return cache.select(torch.tensor(idx, device=cache.count.device)), idx
    n = len(idx)
    kept = set(idx)
    holes = [r for r in range(n) if r not in kept]
    movers = [r for r in idx if r >= n]
    f = cache.frame
    if holes:
        src, dst = torch.tensor(movers, device=f.count.device), torch.tensor(holes, device=f.count.device)
        f.kv[:, dst], f.bias[dst], f.count[dst] = f.kv[:, src], f.bias[src], f.count[src]
    moved = dict(zip(holes, movers))
    return _rows(f, n, cache), [moved.get(r, r) for r in range(n)]


def join(a, b, capacity: int = 0):
    """Rows of `a` then rows of `b`: two frames of the same write column and width. A LeanCache `a` is
    kept in a frame of up to `capacity` rows, into which later joins copy only their own rows."""
    if isinstance(a, LeanCache) and a.prefix is None and b.prefix is None:
        na, nb = a.kv.size(1), b.kv.size(1)
        if not _framed(a) or a.frame.kv.size(1) < na + nb:
            # room for twice the rows (up to `capacity`): a long context's frame is not max_batch rows wide up front
            frame = _Frame(a, max(na + nb, min(capacity, 2 * (na + nb))))
            frame.kv[:, :na], frame.bias[:na], frame.count[:na] = a.kv, a.bias, a.count
            a = _rows(frame, na, a)
        f = a.frame
        f.kv[:, na:na + nb], f.bias[na:na + nb], f.count[na:na + nb] = b.kv, b.bias, b.count
        return _rows(f, na + nb, a)
    if isinstance(a, HFCache):
        for la, lb in zip(_layers(a), _layers(b)):
            la.keys, la.values = torch.cat([la.keys, lb.keys]), torch.cat([la.values, lb.values])
        a.mask, a.count = torch.cat([a.mask, b.mask]), torch.cat([a.count, b.count])
        return a
    out = type(a).__new__(type(a))
    out.__dict__.update(a.__dict__)
    out.kv, out.count = torch.cat([a.kv, b.kv], dim=1), torch.cat([a.count, b.count])
    if isinstance(a, KVCache):
        out.key_valid = torch.cat([a.key_valid, b.key_valid])
    else:
        out.bias = torch.cat([a.bias, b.bias])
    return out
