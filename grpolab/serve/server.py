"""`grpolab serve MODEL`: load a checkpoint (built-in GPT, Hugging Face model directory, LoRA
adapter, or an export) and serve it with uvicorn until Ctrl-C, which drains in-flight requests.

The listening socket is bound before the model loads, so a port in use (or a bad host) is one line
at once, not a traceback after the load; uvicorn then serves on that socket."""

from __future__ import annotations

import errno
import ipaddress
import math
import socket
import sys

from ..errors import ConfigError
from .api import create_app
from .batcher import PREFILL_CHUNK
from .model_loader import KERNEL_CACHE, load_engine
from .prefix_cache import DEFAULT_GIB
from .requests import MAX_REQUEST_BYTES, MAX_ROWS_PER_REQUEST, MAX_WAITING, Server

MAX_PORT = 65535


def is_loopback(host: str) -> bool:
    """Whether `host` only listens on this machine (127.0.0.0/8, ::1, localhost)."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:   # a host name: it may resolve to any interface
        return False


def bind(host: str, port: int) -> socket.socket:
    """A socket bound to (host, port), as uvicorn binds it (port 0: a free one); ConfigError naming the
    address when it cannot be (in use, not this machine's, a privileged port)."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host.strip("[]"), port))
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            why = f"--port {port}: the port is already in use on {host} (another server?); pick another port"
        elif e.errno == errno.EACCES:
            why = f"--port {port}: not allowed to listen on it (ports below 1024 need privileges); pick another port"
        else:
            why = f"--host {host} --port {port}: cannot listen there ({e.strerror or e})"
        raise ConfigError(why) from None
    sock.set_inheritable(True)
    return sock


def serve(model_path: str, host: str = "127.0.0.1", port: int = 8000, max_batch: int = 64,
          name: str | None = None, max_model_len: int | None = None, dtype: str = "float32",
          device: str = "cpu", log_level: str = "info", api_key: str | None = None,
          max_rows_per_request: int | None = None, max_waiting: int | None = None,
          max_request_bytes: int | None = None, prefix_cache_gib: float = DEFAULT_GIB,
          prefill_chunk: int = PREFILL_CHUNK, kernel_cache: int = KERNEL_CACHE) -> None:
    try:
        import uvicorn

    except ImportError:
        raise ImportError("grpolab serve needs FastAPI and uvicorn: pip install 'grpolab[serve]'") from None
    max_rows_per_request = MAX_ROWS_PER_REQUEST if max_rows_per_request is None else max_rows_per_request
    max_waiting = MAX_WAITING if max_waiting is None else max_waiting
    max_request_bytes = MAX_REQUEST_BYTES if max_request_bytes is None else max_request_bytes
    if not 0 <= port <= MAX_PORT:
        raise ConfigError(f"--port must be between 0 and {MAX_PORT}, got {port}")
    if max_rows_per_request < 1 or max_waiting < 1 or max_request_bytes < 1:
        raise ConfigError("--max-rows-per-request, --max-waiting and --max-request-bytes must be >= 1")
    if not (prefix_cache_gib >= 0 and math.isfinite(prefix_cache_gib)):
        raise ConfigError(f"--prefix-cache-gib must be a finite number >= 0 (0: off), got {prefix_cache_gib}")
    if max_rows_per_request > max_waiting:   # such a request could never be queued: a 429 forever
        raise ConfigError(f"--max-rows-per-request ({max_rows_per_request}) must not exceed --max-waiting "
                          f"({max_waiting})")
    if not api_key and not is_loopback(host):
        print(f"grpolab: warning: serving on {host} without an API key: anyone who can reach this port can use "
              f"the model; set --api-key (or GRPOLAB_API_KEY)", file=sys.stderr, flush=True)
    sock = bind(host, port)   # before the load: a port in use fails at once
    try:
        batcher, tok, context = load_engine(model_path, max_batch=max_batch, max_model_len=max_model_len,
                                            dtype=dtype, device=device, prefix_cache_gib=prefix_cache_gib,
                                            prefill_chunk=prefill_chunk, kernel_cache=kernel_cache)
        server = Server(batcher, tok, name or model_path, context, max_rows_per_request=max_rows_per_request,
                        max_waiting=max_waiting, api_key=api_key, max_request_bytes=max_request_bytes)
        shown = f"[{host.strip('[]')}]" if ":" in host else host
        print(f"grpolab: serving {server.name!r} (context {context} tokens, max batch {max_batch}, at most "
              f"{max_rows_per_request} rows per request and {max_waiting} waiting, bodies up to "
              f"{max_request_bytes} bytes, prefix cache "
              f"{f'{prefix_cache_gib:g} GiB' if batcher.prefix_cache is not None else 'off'}, prefill chunk "
              f"{f'{prefill_chunk} tokens' if batcher.decoder is not None and prefill_chunk else 'off'}"
              f"{', API key required' if api_key else ''}) at http://{shown}:{sock.getsockname()[1]}/v1", flush=True)
        config = uvicorn.Config(create_app(server), host=host, port=sock.getsockname()[1], log_level=log_level)
        runner = uvicorn.Server(config)
        try:
            runner.run(sockets=[sock])
        except KeyboardInterrupt:   # uvicorn re-raises the Ctrl-C it drained on: a clean stop (as uvicorn.run)
            pass
        if not runner.started:
            raise OSError(f"the server on {host}:{sock.getsockname()[1]} did not start (uvicorn's log above says why)")
    finally:
        sock.close()
