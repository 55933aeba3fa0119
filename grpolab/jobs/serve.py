"""`grpolab serve MODEL`: the OpenAI-compatible server over the rollout engine."""

from __future__ import annotations

from argparse import Namespace

from ..errors import ConfigError

# the server needs the `serve` extra (FastAPI, uvicorn, prometheus_client); without it only this verb fails
SERVE_EXTRA = ("fastapi", "uvicorn", "prometheus_client", "starlette")
try:
    from ..serve.server import serve
except ModuleNotFoundError as e:
    if (e.name or "").split(".")[0] not in SERVE_EXTRA:
        raise
    serve, MISSING = None, e.name


def run(cfg: None, args: Namespace) -> None:
    """`grpolab serve MODEL`: serve it until stopped."""
    if serve is None:
        raise ConfigError(f"grpolab serve needs the serve extra ({MISSING} is not installed): "
                          f"pip install 'grpolab[serve]'")
    serve(args.model, host=args.host, port=args.port, max_batch=args.max_batch, name=args.name,
          max_model_len=args.max_model_len, dtype=args.dtype, device=args.device, log_level=args.log_level,
          api_key=args.api_key, max_rows_per_request=args.max_rows_per_request, max_waiting=args.max_waiting,
          max_request_bytes=args.max_request_bytes, prefix_cache_gib=args.prefix_cache_gib,
          prefill_chunk=args.prefill_chunk, kernel_cache=args.kernel_cache)
