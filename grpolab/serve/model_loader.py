"""A checkpoint or model directory loaded for serving: the model (LoRA merged), its tokenizer, and the
continuous batcher over the lean decoder where it applies."""

from __future__ import annotations

import os

import torch

from ..errors import ConfigError
from ..models.checkpoint import load_model
from ..models.hf import HFPolicy, resolve_device
from ..models.lean_decode import LeanDecoder, unsupported_reason
from ..models.lora import has_lora
from .batcher import PREFILL_CHUNK, Batcher
from .prefix_cache import BLOCK, DEFAULT_GIB, PrefixCache

KERNEL_CACHE = 256   # compiled oneDNN kernels kept per cache (PyTorch's default: 1024)


def bound_kernel_caches(n: int) -> None:
    """Keep at most `n` compiled kernels in each of the two caches behind PyTorch's CPU matrix products
    (oneDNN's primitive cache and ideep's LRU cache). A kernel is compiled per input shape (rows x weight)
    and holds about 0.3 MiB, so under a serving load, where the rows of a step vary, the defaults let the
    process grow by hundreds of MiB. Both are read at the process's first oneDNN call: before the model loads."""
    os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] = str(n)
    os.environ["LRU_CACHE_CAPACITY"] = str(n)   # 0 crashes PyTorch 2.13: 1 at least


def load_engine(model_path: str, *, max_batch: int = 64, max_model_len: int | None = None,
                dtype: str = "float32", device: str = "cpu", prefix_cache_gib: float = DEFAULT_GIB,
                prefill_chunk: int = PREFILL_CHUNK, kernel_cache: int = KERNEL_CACHE) -> tuple[Batcher, object, int]:
    """(batcher, tokenizer, context length) for a checkpoint or model directory. `prefix_cache_gib`: memory
    for cached prompt prefixes (serve/prefix_cache.py; 0: none), used where the lean decoder applies;
    `prefill_chunk`: prompt tokens prefilled per step while rows decode (batcher.PREFILL_CHUNK; 0: no limit);
    `kernel_cache`: `bound_kernel_caches`'s n."""
    if max_batch < 1:
        raise ConfigError(f"--max-batch must be >= 1, got {max_batch}")
    if prefill_chunk != 0 and prefill_chunk < BLOCK:   # a chunk ends on a block boundary: it holds one at least
        raise ConfigError(f"--prefill-chunk must be 0 (no limit) or at least {BLOCK} tokens, got {prefill_chunk}")
    if kernel_cache < 1:
        raise ConfigError(f"--kernel-cache must be >= 1, got {kernel_cache}")
    # CUDA this machine lacks is one line naming the flag, as `grpolab train` gives it, before any loading;
    # "auto" becomes the device it means (a built-in checkpoint's .to() takes no "auto")
    device = str(resolve_device(device, "--device"))
    bound_kernel_caches(kernel_cache)
    model, tok = load_model(model_path, dtype=dtype, device=device)
    model.eval()
    # never trains: merged, the lean path applies
    if isinstance(model, HFPolicy) and has_lora(model) and hasattr(model.hf, "merge_and_unload"):
        model.hf = model.hf.merge_and_unload()
    if isinstance(model, HFPolicy):
        limit = getattr(model.config, "max_position_embeddings", None) or 2048
    else:
        limit = model.config.block_size
    if max_model_len is not None and not 1 < max_model_len <= limit:
        raise ConfigError(f"--max-model-len must be between 2 and the model's {limit} positions, got {max_model_len}")
    context = max_model_len or limit
    decoder = None
    if isinstance(model, HFPolicy):
        if unsupported_reason(model.hf, context) is None:
            with torch.inference_mode():   # fused weights, built once: the served model never changes
                decoder = LeanDecoder(model.hf, context)
        else:   # HF's own forward and DynamicCache: rows move between columns only in plain layers
            from transformers import DynamicCache
            from transformers.cache_utils import DynamicLayer
            if any(type(layer) is not DynamicLayer for layer in DynamicCache(config=model.config).layers):
                raise ConfigError(f"{model_path}: {model.config.model_type} uses sliding-window (or other special) "
                                  f"cache layers, which continuous batching does not support yet")
    prefix = PrefixCache(int(prefix_cache_gib * 2**30)) if decoder is not None and prefix_cache_gib > 0 else None
    return Batcher(model, tok, max_batch=max_batch, context=context, decoder=decoder, prefix_cache=prefix,
                   prefill_chunk=prefill_chunk), tok, context
