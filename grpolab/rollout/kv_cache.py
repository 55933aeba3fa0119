"""The KV cache of a batched decode, where rows leave (rollouts and the server) and join (the server)
between steps.

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
from ..models.lean_decode import LeanCache, store_rows


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


def place(cache, pos: int, cols: int | None, joining: int = 0, capacity: int = 0):
    """The same rows with their last min(pos, old pos) columns moved to end at column `pos`, in a frame
    of `cols` columns (ignored for HF's growing cache). The caller keeps every row's real tokens:
    pos >= the largest count. A LeanCache about to `join` `joining` rows (up to `capacity`) gets the
    room for them in the same new frame."""
    if isinstance(cache, LeanCache):
        n = cache.kv.size(1)
        return cache.place(pos, cols, store_rows(n + joining, capacity) if joining else 0)
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
    out.key_valid = cache.key_valid.new_zeros((cache.key_valid.size(0), cols))
    out.key_valid[:, pos - k:pos] = cache.key_valid[:, old - k:old]
    out.pos, out.max_len = pos, cols
    return out


def nbytes(cache) -> int:
    """Bytes of the tensors a batch's cache holds (a LeanCache's whole store, however few rows it uses;
    0 for no cache)."""
    if cache is None:
        return 0
    if isinstance(cache, HFCache):
        tensors = [t for layer in cache.past.layers for t in (layer.keys, layer.values)] + [cache.mask, cache.count]
    else:
        parts = [cache, getattr(cache, "store", None), getattr(cache, "prefix", None)]
        tensors = [t for part in parts if part is not None for t in vars(part).values()]
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in tensors if isinstance(t, torch.Tensor)}
    return sum(storages.values())


def moves_rows(cache) -> bool:
    """Whether `keep` moves only the rows that fill the leavers' places (a LeanCache), rather than
    copying every row that stays."""
    return isinstance(cache, LeanCache)


def leave_now(cache, finished: int, rows: int) -> bool:
    """Whether the `finished` of a batch's `rows` should leave now: any from a LeanCache (only the rows
    that fill their places move); from the others, whose `select` copies every row that stays, once
    they are a quarter of the batch."""
    return finished > 0 and (moves_rows(cache) or finished * 4 >= rows)


def keep(cache, idx: torch.Tensor) -> tuple[object, torch.Tensor]:
    """The rows `idx` (indices, increasing) of a batch's cache, and the order they are in: `idx` itself
    (the cache's own `select(rows)`), or for a LeanCache the kept rows where they were, each leaving row's
    place taken by one of the last kept rows (`LeanCache.compact`: only those are copied)."""
    if moves_rows(cache):
        return cache.compact(idx)
    return cache.select(idx), idx


def join(a, b, capacity: int = 0):
    """Rows of `a` then rows of `b`, b's columns placed to end at a's write column (b's own write column is
    at most a's). A LeanCache `a` is kept in a frame of up to `capacity` rows, into which later joins copy
    only their own rows."""
    if isinstance(a, LeanCache):
        return a.extend(b, capacity)
    b = place(b, write_pos(a), width(a))
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
