"""OpenAI-compatible HTTP API over the batcher (FastAPI): /v1/models, /v1/completions (with `echo` and
prompt log-probs, echo.py), /v1/chat/completions (streamed as server-sent events when asked), /health,
and vLLM's /tokenize, /detokenize, /tokenizer_info (tokenize.py), /version and /metrics (metrics.py).

Requests are validated and turned into `Job`s in requests.py and answered in responses.py; the
batcher decodes every request's rows together in its own thread and reports each new token back to
the request's event loop. Errors use OpenAI's shape, {"error": {"message", "type", "param", "code"}},
with status 400 for a bad request (so OpenAI clients raise BadRequestError), 401 for a missing or
wrong API key (with `--api-key`), 429 when the waiting queue is full (clients retry) and 500 for a
failed step.

Ceilings: a body of at most `max_request_bytes` (a 413 beyond, before it is read: body_limit.py), a text
no longer than the context can hold (a 400 before tokenizing), at most `max_rows_per_request` rows
(prompts × n; a 400 beyond),
and at most `max_waiting` rows may wait for a place in the batch (a 429 beyond), so one huge
request or a flood cannot hold the server for minutes or grow its memory without bound.
"""

from __future__ import annotations

import secrets
import time
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException

from .. import __version__
from ..rollout import kv_cache
from .body_limit import LimitBody
from .metrics import CONTENT_TYPE, CountRequests
from .requests import APIError, ChatRequest, CompletionRequest, Server, error_body
from .responses import respond
from .tokenize import DetokenizeRequest, TokenizeRequest, encode, tokenize_body, tokenizer_info


def create_app(server: Server) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app):
        server.start()
        yield
        server.stop()   # after uvicorn has let in-flight requests finish

    app = FastAPI(title="grpolab", lifespan=lifespan)
    app.add_middleware(LimitBody, limit=server.max_request_bytes)   # inside RequireKey: the key is checked first
    if server.api_key:
        app.add_middleware(RequireKey, key=server.api_key)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError):
        return JSONResponse(error_body(e.message, e.param, e.code, e.kind), status_code=e.status, headers=e.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, e: RequestValidationError):
        errs = e.errors()
        first = errs[0] if errs else {}
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        if first.get("type") == "json_invalid":
            why = first.get("ctx", {}).get("error", "parse error")
            msg, param = f"the request body is not valid JSON ({why})", None
        elif first.get("type") == "extra_forbidden":   # a field we do not implement: refused, never ignored
            param = ".".join(loc) or None
            msg = f"{param}: not supported by this server; remove it (docs/serving.md lists the fields it takes)"
        else:
            param = ".".join(loc) or None
            msg = f"{param}: {first.get('msg', 'invalid')}" if param else str(first.get("msg", "invalid request"))
        return JSONResponse(error_body(msg, param), status_code=400)

    @app.exception_handler(HTTPException)
    async def _http(request: Request, e: HTTPException):
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return JSONResponse(error_body(str(e.detail), kind=kind), status_code=e.status_code)

    @app.get("/health")
    async def health():
        b = server.batcher
        return {"status": "ok", "running": b.running, "waiting": b.waiting, "waiting_rows": b.waiting_rows,
                "steps": b.steps, "preparing": server.preparing, "kv_cache_bytes": kv_cache.nbytes(b.cache),
                "prefix_cache_bytes": 0 if b.prefix_cache is None else b.prefix_cache.bytes}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": server.name, "object": "model", "created": int(time.time()),
                                            "owned_by": "grpolab", "max_model_len": server.context}]}

    @app.post("/v1/completions")
    async def completions(r: CompletionRequest, request: Request):
        start = time.monotonic()
        prompts, echo, params = await server.prepared(server.completion_request, r)
        return await respond(server, r, prompts, params, chat=False, request=request, echo=echo, start=start)

    @app.post("/v1/chat/completions")
    async def chat(r: ChatRequest, request: Request):
        start = time.monotonic()
        prompt, params, plan = await server.prepared(server.chat_request, r)
        return await respond(server, r, [prompt], params, chat=True, request=request, start=start,
                              plan=plan if plan.parse else None)

    @app.post("/tokenize")
    async def tokenize(r: TokenizeRequest):
        if r.model is not None:
            server._check_model(r.model)
        if (r.prompt is None) == (r.messages is None):
            raise APIError("give either 'prompt' (a string) or 'messages' (chat messages), not both or neither",
                           "prompt")
        if r.messages is not None:
            if not r.add_generation_prompt or r.add_special_tokens:
                raise APIError("messages are tokenized as /v1/chat/completions renders them (with the generation "
                               "prompt, no extra special tokens)", "add_generation_prompt")
        return Response(await server.prepared(tokenized, server, r), media_type="application/json")

    @app.post("/detokenize")
    async def detokenize(r: DetokenizeRequest):
        if r.model is not None:
            server._check_model(r.model)
        return {"prompt": await server.prepared(detokenized, server.tok, r.tokens)}

    @app.get("/tokenizer_info")
    async def get_tokenizer_info():
        return tokenizer_info(server.tok, server.context)

    @app.get("/version")
    async def version():
        return {"version": __version__}

    @app.get("/metrics")
    async def metrics():
        return Response(server.metrics.render(), media_type=CONTENT_TYPE)

    # outermost: a refused key (401) or a malformed body (400) is counted too
    app.add_middleware(CountRequests, metrics=server.metrics, paths={route.path for route in app.routes})
    return app


def tokenized(server: Server, r: TokenizeRequest) -> bytes:
    """/tokenize's response body, run in the preparing thread whole: tokenizing, token strings and the JSON of
    a document of millions of tokens each take seconds, which on the event loop would hold /health too."""
    if r.messages is not None:
        ids = server.chat_prompt(ChatRequest(model=server.name, messages=r.messages))
    else:   # no length check: lm-eval tokenizes whole documents to cut them into context-sized windows
        ids = encode(server.tok, r.prompt, r.add_special_tokens is not False)
    return tokenize_body(server.tok, ids, server.context, r.return_token_strs)


def detokenized(tok, ids: list[int]) -> str:
    """/detokenize's text (a 400 for an id outside the vocabulary), in the preparing thread as /tokenize."""
    bad = next((t for t in ids if not 0 <= t < tok.vocab_size), None)
    if bad is not None:
        raise APIError(f"tokens: {bad} is not a token id of this model (ids are in [0, {tok.vocab_size}))", "tokens")
    return tok.decode(ids, skip_special=False)


class RequireKey:
    """ASGI middleware: with `--api-key`, every request but GET /health needs `Authorization: Bearer KEY`
    (vLLM's --api-key guards /v1/*; here the docs pages are guarded too). Checked before the body is
    read, so an unauthenticated client learns nothing about the API, not even a validation error."""

    def __init__(self, app, key: str) -> None:
        self.app, self.key = app, key.encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"] != "/health" and not self._ok(scope):
            body = error_body("missing or incorrect API key: send the header 'Authorization: Bearer <key>' "
                               "with the key the server was started with (--api-key or GRPOLAB_API_KEY)",
                               code="invalid_api_key")
            await JSONResponse(body, status_code=401, headers={"WWW-Authenticate": "Bearer"})(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def _ok(self, scope) -> bool:
        given = dict(scope.get("headers") or []).get(b"authorization", b"")
        scheme, _, token = given.partition(b" ")
        # compare_digest: the time taken does not tell how much of a guess was right
        return scheme.lower() == b"bearer" and secrets.compare_digest(token.strip(), self.key)

