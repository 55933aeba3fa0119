"""`grpolab serve MODEL`: load a checkpoint (built-in GPT, Hugging Face model directory, LoRA
adapter, or an export) and serve it with uvicorn until Ctrl-C, which drains in-flight requests."""

from __future__ import annotations

import torch

from ..config import ConfigError
from .batcher import Batcher


def load_engine(model_path: str, *, max_batch: int = 64, max_model_len: int | None = None,
                dtype: str = "float32", device: str = "cpu") -> tuple[Batcher, object, int]:
    """(batcher, tokenizer, context length) for a checkpoint or model directory."""
    from ..models.hf import HFPolicy
    from ..models.lean_decode import LeanDecoder, unsupported_reason
    from ..models.lora import has_lora
    from ..train.checkpoint import load_model

    if max_batch < 1:
        raise ConfigError(f"--max-batch must be >= 1, got {max_batch}")
    model, tok = load_model(model_path, dtype=dtype, device=device)
    model.eval()
    if isinstance(model, HFPolicy) and has_lora(model) and hasattr(model.hf, "merge_and_unload"):   # never trains: merged, the lean path applies
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
    return Batcher(model, tok, max_batch=max_batch, context=context, decoder=decoder), tok, context


def serve(model_path: str, host: str = "127.0.0.1", port: int = 8000, max_batch: int = 64,
          name: str | None = None, max_model_len: int | None = None, dtype: str = "float32",
          device: str = "cpu", log_level: str = "info") -> None:
    try:
        import uvicorn

        from .api import Server, create_app
    except ImportError:
        raise ImportError("grpolab serve needs FastAPI and uvicorn: pip install 'grpolab[serve]'") from None
    batcher, tok, context = load_engine(model_path, max_batch=max_batch, max_model_len=max_model_len,
                                        dtype=dtype, device=device)
    server = Server(batcher, tok, name or model_path, context)
    print(f"grpolab: serving {server.name!r} (context {context} tokens, max batch {max_batch}) at "
          f"http://{host}:{port}/v1", flush=True)
    uvicorn.run(create_app(server), host=host, port=port, log_level=log_level)
