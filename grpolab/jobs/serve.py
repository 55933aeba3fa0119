"""`grpolab serve MODEL`: the OpenAI-compatible server over the rollout engine."""

from __future__ import annotations

from ..serve.server import serve


def run(model: str, **options) -> None:
    """Serve `model` until stopped; `options` are serve()'s keywords (host, port, max_batch, ...)."""
    serve(model, **options)
