"""OpenAI-compatible HTTP API over the batcher (FastAPI): /v1/models, /v1/completions (with `echo` and
prompt log-probs, echo.py), /v1/chat/completions (streamed as server-sent events when asked), /health,
and vLLM's /tokenize, /detokenize, /tokenizer_info (tokenize.py), /version and /metrics (metrics.py).

Requests are validated here and turned into `Job`s; the batcher decodes every request's rows
together in its own thread and reports each new token back to the request's event loop. Errors
use OpenAI's shape, {"error": {"message", "type", "param", "code"}}, with status 400 for a bad
request (so OpenAI clients raise BadRequestError), 401 for a missing or wrong API key (with
`--api-key`), 429 when the waiting queue is full (clients retry) and 500 for a failed step.

Ceilings: one request may ask for at most `max_rows_per_request` rows (prompts × n; a 400 beyond),
and at most `max_waiting` rows may wait for a place in the batch (a 429 beyond), so one huge
request or a flood cannot hold the server for minutes or grow its memory without bound.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import secrets
import threading
import time
import uuid
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException

from .. import __version__
from ..data.messages import canonical_role, role_problem
from ..rollout.structured import BadConstraint, Constraint
from .batcher import MAX_LOGPROBS, BadSampling, Batcher, Choice, Job, SamplingParams, held_back
from .echo import Echo, completion_choice, echo_chunk, legacy_logprobs
from .metrics import CONTENT_TYPE, CountRequests, Metrics
from .tokenize import DetokenizeRequest, TokenizeRequest, encode, raw_ids, token_strs, tokenizer_info
from .tool_calls import (
    ToolPlan,
    ToolRequestError,
    builtin_prompt,
    hf_messages,
    history_calls,
    is_builtin,
    new_call_id,
    parse_reply,
    plan_tools,
    tool_support,
)

# defaults of `grpolab serve --max-rows-per-request` and `--max-waiting` (rows = prompts × n)
MAX_ROWS_PER_REQUEST = 1024
MAX_WAITING = 4096


class APIError(Exception):
    def __init__(self, message: str, param: str | None = None, status: int = 400, code: str | None = None,
                 kind: str | None = None, headers: dict | None = None) -> None:
        super().__init__(message)
        self.message, self.param, self.status, self.code = message, param, status, code
        self.kind = kind or ("server_error" if status >= 500 else "invalid_request_error")
        self.headers = headers


class _Sampling(BaseModel):
    """Settings both endpoints take. A field not declared here is refused (a 400 naming it) rather than
    silently ignored; the declared ones are implemented, or harmless to ignore (`user`, `metadata`, ...)."""
    model_config = ConfigDict(extra="forbid")
    model: str
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0                        # vLLM's extension (openai client: extra_body); 0 or -1: off
    n: int = 1
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: dict | None = None    # {"include_usage": true}: a last chunk with usage
    # logits processors (grpolab/rollout/logits_processors.py; docs/serving.md)
    logit_bias: dict[str, float] | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0       # vLLM's extensions from here
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    best_of: int | None = None            # only None or n (vLLM 0.32 dropped it too); see Server._params
    # structured output: OpenAI's response_format or vLLM's structured_outputs (one of them)
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    # accepted and ignored: they change nothing about the completion
    user: str | None = None
    metadata: dict[str, Any] | None = None
    store: bool | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False
    prompt_logprobs: int | None = None


class ChatRequest(_Sampling):
    messages: list[dict[str, Any]] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None


def _error_body(message: str, param: str | None = None, code: str | None = None,
                kind: str = "invalid_request_error") -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


# vLLM's structured_outputs keys: one constraint, plus the one option implemented here
_STRUCTURED = {"json": "json", "regex": "regex", "choice": "choice", "grammar": "grammar", "json_object": "json_object"}


def _constraint(r: _Sampling) -> tuple[Constraint | None, str]:
    """The request's structured-output constraint and the field it came from (APIError when malformed)."""
    if r.response_format is not None and r.structured_outputs is not None:
        raise APIError("give response_format or structured_outputs, not both", "structured_outputs")
    if r.response_format is not None:
        f, param = r.response_format, "response_format"
        kind = f.get("type")
        if kind == "text":
            return None, param
        if kind == "json_object":
            return Constraint("json_object"), param
        if kind == "json_schema":
            schema = (f.get("json_schema") or {}).get("schema")
            if not isinstance(schema, dict):
                raise APIError('response_format: type "json_schema" needs {"json_schema": {"name": ..., "schema": '
                               '{...}}} with the schema an object', param)
            return Constraint("json", json.dumps(schema)), param
        raise APIError(f'response_format.type must be "text", "json_object" or "json_schema", got {kind!r}', param)
    if r.structured_outputs is None:
        return None, ""
    s, param = dict(r.structured_outputs), "structured_outputs"
    any_whitespace = not s.pop("disable_any_whitespace", False)
    given = [k for k in s if s[k] not in (None, False)]
    unknown = [k for k in given if k not in _STRUCTURED]
    if unknown:
        raise APIError(f"structured_outputs.{unknown[0]} is not supported; use one of {', '.join(_STRUCTURED)} "
                       f"(and disable_any_whitespace)", f"structured_outputs.{unknown[0]}")
    if len(given) != 1:
        raise APIError(f"structured_outputs needs exactly one of {', '.join(_STRUCTURED)}, got {given or 'none'}",
                       param)
    kind, spec = given[0], s[given[0]]
    if kind == "json_object":
        return Constraint("json_object", any_whitespace=any_whitespace), param
    if kind in ("json", "choice") and not isinstance(spec, str):
        spec = json.dumps(spec)
    if not isinstance(spec, str):
        raise APIError(f"structured_outputs.{kind} must be a string", f"structured_outputs.{kind}")
    return Constraint(kind, spec, any_whitespace), param


class Server:
    """The app's state: the batcher (and its thread), the tokenizer, the served model's name, the
    ceilings on a request's rows and on the rows waiting, and the API key (None: none needed)."""

    def __init__(self, batcher: Batcher, tok, name: str, context: int, *,
                 max_rows_per_request: int = MAX_ROWS_PER_REQUEST, max_waiting: int = MAX_WAITING,
                 api_key: str | None = None) -> None:
        self.batcher, self.tok, self.name, self.context = batcher, tok, name, context
        self.max_rows_per_request, self.max_waiting = max_rows_per_request, max_waiting
        self.api_key = api_key or None
        self.thread: threading.Thread | None = None
        self.metrics = Metrics(batcher)   # its own registry: two servers in one process count apart

    def start(self) -> None:
        self.thread = threading.Thread(target=self.batcher.run, name="grpolab-batcher", daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.batcher.stop()
        if self.thread is not None:
            self.thread.join()

    # ---- request -> jobs ---------------------------------------------------------------------
    def _check_model(self, name: str) -> None:
        if name != self.name:
            raise APIError(f"model {name!r} is not served here; this server serves {self.name!r} (GET /v1/models)",
                           "model", code="model_not_found")

    def check_rows(self, prompts: int, n: int) -> None:
        """A 400 for a request of more rows (prompts × n) than --max-rows-per-request, before any tokenizing."""
        rows = prompts * max(n, 1)
        if rows > self.max_rows_per_request:
            asked = f"{prompts} prompts × n={n} = {rows} rows" if prompts > 1 else f"n={n} rows"
            raise APIError(f"request too big: it asks for {asked}, but this server takes at most "
                           f"{self.max_rows_per_request} rows (prompts × n) per request (--max-rows-per-request); "
                           f"split it into smaller requests", "prompt" if prompts > 1 else "n",
                           code="request_too_large")

    def _params(self, r: _Sampling, prompt_len: int, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        if prompt_len >= self.context:
            raise APIError(f"the prompt is {prompt_len} tokens, but the model's context is {self.context} tokens "
                           f"(prompt plus completion); shorten the prompt",
                           "prompt" if hasattr(r, "prompt") else "messages")
        room = self.context - prompt_len
        if max_tokens is None:
            max_tokens = room
        if max_tokens > room:
            raise APIError(f"the model's context is {self.context} tokens; the prompt takes {prompt_len}, which "
                           f"leaves {room} for the completion, but max_tokens is {max_tokens}", "max_tokens")
        if r.n > self.batcher.max_batch:
            raise APIError(f"n must be between 1 and the server's max batch ({self.batcher.max_batch}), got {r.n}", "n")
        if r.best_of is not None and r.best_of != r.n:
            raise APIError(f"best_of is not supported (only best_of = n, here {r.n}): sample n completions with "
                           f"logprobs and rank them yourself (vLLM 0.32 dropped best_of too)", "best_of")
        vocab = self.tok.vocab_size
        bias = {}
        for key, value in (r.logit_bias or {}).items():
            if not key.strip().isdigit() or int(key) >= vocab:
                raise APIError(f"logit_bias: key {key!r} is not a token id in [0, {vocab})", "logit_bias")
            bias[int(key)] = value
        if any(not 0 <= t < vocab for t in r.stop_token_ids or ()):
            raise APIError(f"stop_token_ids must be token ids in [0, {vocab})", "stop_token_ids")
        constraint, param = _constraint(r)
        if constraint is not None:
            try:
                self.batcher.grammars.compile(constraint)
            except BadConstraint as e:
                raise APIError(f"{param}: {e}", param) from None
        try:
            return SamplingParams(max_tokens=max_tokens, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
                                  n=r.n, stop=r.stop, seed=r.seed, logprobs=logprobs, logit_bias=bias,
                                  stop_token_ids=tuple(r.stop_token_ids or ()), min_tokens=r.min_tokens,
                                  presence_penalty=r.presence_penalty, frequency_penalty=r.frequency_penalty,
                                  repetition_penalty=r.repetition_penalty, constraint=constraint)
        except BadSampling as e:
            raise APIError(str(e), e.param) from None

    def completion_prompts(self, r: CompletionRequest) -> list[list[int]]:
        p = r.prompt
        if isinstance(p, str):
            prompts = [raw_ids(self.tok, p)]
        elif p and all(isinstance(x, str) for x in p):
            prompts = [raw_ids(self.tok, x) for x in p]
        elif p and all(isinstance(x, int) for x in p):
            prompts = [list(p)]
        elif p and all(isinstance(x, list) for x in p):
            prompts = [list(x) for x in p]
        else:
            raise APIError("prompt must be a string, a list of strings, a list of token ids, or a list of them",
                           "prompt")
        vocab = self.tok.vocab_size
        for ids in prompts:
            if not ids:
                raise APIError("the prompt is empty", "prompt")
            if any(not 0 <= t < vocab for t in ids):
                raise APIError(f"prompt token ids must be in [0, {vocab})", "prompt")
        return prompts

    def tool_plan(self, r: ChatRequest) -> ToolPlan:
        """How the request uses tools (tool_calls.plan_tools); a 400 naming the field when it cannot."""
        if r.tools and not hasattr(self, "_tool_problem"):   # the template's checks run once, at the first use
            self._tool_problem = tool_support(self.tok)
        try:
            return plan_tools(self.tok, r.tools, r.tool_choice, getattr(self, "_tool_problem", None))
        except ToolRequestError as e:
            raise APIError(str(e), e.param) from None

    def chat_prompt(self, r: ChatRequest, plan: ToolPlan | None = None) -> list[int]:
        """The conversation rendered as training renders it (tools, calls and results included), then the
        text a forced tool_choice makes the reply start with."""
        plan = plan or self.tool_plan(r)
        messages = []
        for i, m in enumerate(r.messages):
            role, content = m.get("role"), m.get("content")
            problem = role_problem(role)   # the same rule as training data's
            if problem:
                raise APIError(f"messages[{i}].{problem}", f"messages[{i}].role")
            if isinstance(content, list):   # content parts: the text ones, joined
                if any(not isinstance(x, dict) or x.get("type") != "text" for x in content):
                    raise APIError(f"messages[{i}].content: only text parts are supported", f"messages[{i}].content")
                content = "".join(str(x.get("text", "")) for x in content)
            if content is None:
                content = ""
            if not isinstance(content, str):
                raise APIError(f"messages[{i}].content must be a string or a list of text parts",
                               f"messages[{i}].content")
            messages.append({"role": canonical_role(role), "content": content, "tool_call_id": m.get("tool_call_id"),
                             "tool_calls": m.get("tool_calls")})
        try:
            calls, names = history_calls(messages)
        except ToolRequestError as e:
            raise APIError(str(e), e.param) from None
        history = any(calls) or any(n is not None for n in names)
        try:
            if is_builtin(self.tok):
                ids = builtin_prompt(self.tok, messages, calls, plan.tools) if history else \
                    self.tok.render_prompt(messages)
            else:
                ids = self.tok.render_prompt(hf_messages(self.tok, messages, calls, names),
                                             tools=r.tools if plan.parse else None)
        except ValueError as e:
            raise APIError(str(e), "messages") from None
        except Exception as e:   # noqa: BLE001 - a chat template's own refusal (jinja's error or raise_exception)
            raise APIError(f"the model's chat template cannot render these messages ({type(e).__name__}: "
                           f"{str(e).splitlines()[0] if str(e) else ''})", "messages") from None
        return ids + (self.tok.encode(plan.prefix) if plan.prefix else [])

    def jobs(self, prompts: list[list[int]], params: SamplingParams, loop: asyncio.AbstractEventLoop,
             events: asyncio.Queue, stream: bool, prompt_logprobs: int | None = None) -> list[Job]:
        """Submit one job per prompt; updates (each token when streaming, else each finished choice)
        arrive on `events` as (job number, choice index, text so far, done, tokens so far): a snapshot
        taken in the batcher's thread, so the text and the token count belong together. With
        `prompt_logprobs` (top k), each job's prefill scores its prompt tokens too."""
        rows, waiting = len(prompts) * params.n, self.batcher.waiting_rows
        if waiting + rows > self.max_waiting:   # refused whole: a request never waits half-queued
            raise APIError(f"the server is busy: {waiting} rows are waiting for a place in the batch and this request "
                           f"adds {rows}, over the server's limit of {self.max_waiting} (--max-waiting); retry later",
                           status=429, code="queue_full", kind="rate_limit_error", headers={"Retry-After": "1"})
        jobs = []
        for k, ids in enumerate(prompts):
            def notify(job, choice, k=k):
                try:
                    loop.call_soon_threadsafe(events.put_nowait,
                                              (k, choice.index, choice.text, choice.done, len(choice.tokens)))
                except RuntimeError:   # the request's event loop is gone (shutting down): nobody to tell
                    pass
            jobs.append(Job(ids, params, notify, draw=k, live=stream, prompt_logprobs=prompt_logprobs))
        for job in jobs:
            self.batcher.submit(job)
        return jobs


def create_app(server: Server) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app):
        server.start()
        yield
        server.stop()   # after uvicorn has let in-flight requests finish

    app = FastAPI(title="grpolab", lifespan=lifespan)
    if server.api_key:
        app.add_middleware(RequireKey, key=server.api_key)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError):
        return JSONResponse(_error_body(e.message, e.param, e.code, e.kind), status_code=e.status, headers=e.headers)

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
        return JSONResponse(_error_body(msg, param), status_code=400)

    @app.exception_handler(HTTPException)
    async def _http(request: Request, e: HTTPException):
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return JSONResponse(_error_body(str(e.detail), kind=kind), status_code=e.status_code)

    @app.get("/health")
    async def health():
        b = server.batcher
        return {"status": "ok", "running": b.running, "waiting": b.waiting, "waiting_rows": b.waiting_rows,
                "steps": b.steps}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": server.name, "object": "model", "created": int(time.time()),
                                            "owned_by": "grpolab", "max_model_len": server.context}]}

    @app.post("/v1/completions")
    async def completions(r: CompletionRequest, request: Request):
        start = time.monotonic()
        server._check_model(r.model)
        p = r.prompt   # a list of strings or of id lists is a batch of prompts; checked before tokenizing them
        server.check_rows(len(p) if isinstance(p, list) and p and not isinstance(p[0], int) else 1, r.n)
        prompts = server.completion_prompts(r)
        echo = _echo(server.tok, r, prompts)
        # max_tokens 0 with echo (vLLM's): one token is sampled, as for any request, and not returned
        params = server._params(r, max(len(p) for p in prompts), r.max_tokens if echo.generate else 1, r.logprobs)
        return await _respond(server, r, prompts, params, chat=False, request=request, echo=echo, start=start)

    @app.post("/v1/chat/completions")
    async def chat(r: ChatRequest, request: Request):
        start = time.monotonic()
        server._check_model(r.model)
        server.check_rows(1, r.n)
        plan = server.tool_plan(r)
        prompt = server.chat_prompt(r, plan)
        top = (r.top_logprobs or 0) if r.logprobs else None
        params = server._params(r, len(prompt), r.max_completion_tokens or r.max_tokens, top)
        if plan.stop:   # the built-in model's call end: the reply ends at a call, which the client runs
            params = dataclasses.replace(params, stop=params.stop + plan.stop)
        return await _respond(server, r, [prompt], params, chat=True, request=request, start=start,
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
            ids = server.chat_prompt(ChatRequest(model=server.name, messages=r.messages))
        else:
            ids = encode(server.tok, r.prompt, r.add_special_tokens is not False)
        return {"count": len(ids), "max_model_len": server.context, "tokens": ids,
                "token_strs": token_strs(server.tok, ids) if r.return_token_strs else None}

    @app.post("/detokenize")
    async def detokenize(r: DetokenizeRequest):
        if r.model is not None:
            server._check_model(r.model)
        vocab = server.tok.vocab_size
        bad = next((t for t in r.tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise APIError(f"tokens: {bad} is not a token id of this model (ids are in [0, {vocab}))", "tokens")
        return {"prompt": server.tok.decode(r.tokens, skip_special=False)}

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


def _echo(tok, r: CompletionRequest, prompts: list[list[int]]) -> Echo:
    """What a completions request wants back besides its completions (see echo.py); a 400 for prompt
    log-probs out of range or asked for a stream."""
    k = r.prompt_logprobs
    if k is not None and not 0 <= k <= MAX_LOGPROBS:
        raise APIError(f"prompt_logprobs must be between 0 and {MAX_LOGPROBS}, got {k}", "prompt_logprobs")
    if r.stream and k is not None:   # as vLLM: the field belongs to a whole response
        raise APIError("prompt_logprobs is not supported with stream; ask with stream: false", "prompt_logprobs")
    texts = None
    if r.echo:   # a text prompt comes back as it was given; token ids as they decode
        p = r.prompt
        given = [p] if isinstance(p, str) else p if p and isinstance(p[0], str) else None
        texts = given or [tok.decode(ids, skip_special=False) for ids in prompts]
    if k is None and r.echo:   # vLLM's: echo with logprobs scores the prompt with that many alternatives
        k = r.logprobs
    scores = [x for x in (k, r.logprobs if r.echo else None) if x is not None]
    return Echo(texts, generate=not (r.echo and r.max_tokens == 0), prompt_logprobs=k,
                scores=max(scores) if scores else None)


async def _respond(server: Server, r: _Sampling, prompts: list[list[int]], params: SamplingParams, chat: bool,
                   request: Request, echo: Echo | None = None, start: float | None = None,
                   plan: ToolPlan | None = None):
    echo = echo or Echo()
    arrived = time.monotonic() if start is None else start
    loop = asyncio.get_running_loop()
    events: asyncio.Queue = asyncio.Queue()
    jobs = server.jobs(prompts, params, loop, events, r.stream, prompt_logprobs=echo.scores)
    rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    created = int(time.time())
    head = {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
            "model": server.name}
    n = params.n
    # every (job, choice) still to report done; a failed batch step ends the wait too
    pending = {(k, j) for k in range(len(jobs)) for j in range(n)}

    def failed() -> str | None:
        return next((j.error for j in jobs if j.error), None)

    def usage() -> dict:
        completion = sum(len(c.tokens) for j in jobs for c in j.choices) if echo.generate else 0
        prompt = sum(len(p) for p in prompts)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    if not r.stream:
        try:
            while pending and not failed():
                try:
                    k, j, _, done, _ = await asyncio.wait_for(events.get(), timeout=0.25)
                except asyncio.TimeoutError:
                    if await request.is_disconnected():   # nobody to answer: free the rows
                        break
                    continue
                if done:
                    pending.discard((k, j))
        finally:
            for j in jobs:
                j.cancel()   # a no-op when done
        if failed():
            raise APIError(f"generation failed: {failed()}", status=500, code="server_error")
        choices = []
        for k, job in enumerate(jobs):
            for c in job.choices:
                choice = {"index": k * n + c.index, "finish_reason": c.finish_reason}
                if chat:
                    choice["logprobs"] = _logprobs(server.tok, c, chat) if params.logprobs is not None else None
                if chat and plan is not None:   # the reply split into content and tool calls
                    content, calls = parse_reply(plan.marks, plan.tools, _reply(server.tok, plan, c, c.text))
                    choice["message"] = {"role": "assistant", "content": content}
                    if calls:
                        choice["message"]["tool_calls"] = [x.openai(new_call_id()) for x in calls]
                        choice["finish_reason"] = _finish(c, True)
                elif chat:
                    choice["message"] = {"role": "assistant", "content": c.text}
                else:
                    choice.update(completion_choice(server.tok, job, c, echo.texts[k] if echo.texts else None,
                                                    echo.generate, params.logprobs, echo.prompt_logprobs))
                choices.append(choice)
        used = usage()
        server.metrics.answered(arrived, jobs, used)
        return {**head, "choices": choices, "usage": used}

    head["object"] = "chat.completion.chunk" if chat else "text_completion"
    include_usage = bool((r.stream_options or {}).get("include_usage"))

    def chunk(index: int, text: str | None, finish: str | None, logprobs=None, role: bool = False,
              delta: dict | None = None) -> str:
        if chat:
            if delta is None:
                delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text else {})
            body = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        else:
            body = {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish}
        return f"data: {json.dumps({**head, 'choices': [body]})}\n\n"

    parsers = {(k, j): plan.parser() for k in range(len(jobs)) for j in range(n)} if plan is not None else {}

    def tool_chunks(k: int, j: int, text: str, done: bool, lp) -> list[str]:
        """A choice's update with tools: its content and each call as it closes (the call's id, type and
        name first, then its arguments, as OpenAI streams them); log-probs on the first chunk, the finish
        reason on the last."""
        p, c = parsers[(k, j)], jobs[k].choices[j]
        before = p.n_calls
        deltas = []
        for kind, x in p.feed(_reply(server.tok, plan, c, text) if done else plan.prefix + text, done):
            if kind == "content":
                deltas.append({"content": x})
                continue
            i = before + sum("tool_calls" in d for d in deltas) // 2
            deltas.append({"tool_calls": [{"index": i, "id": new_call_id(), "type": "function",
                                           "function": {"name": x.name, "arguments": ""}}]})
            deltas.append({"tool_calls": [{"index": i, "function": {"arguments": x.arguments}}]})
        if not deltas and (lp is not None or done):
            deltas = [{}]
        last = len(deltas) - 1
        return [chunk(k * n + j, None, _finish(c, p.n_calls > 0) if done and m == last else None,
                      lp if m == 0 else None, delta=d) for m, d in enumerate(deltas)]

    async def stream():
        sent: dict[tuple[int, int], int] = {}
        lp_sent: dict[tuple[int, int], int] = {}
        echoed: set[tuple[int, int]] = set()
        try:
            if chat:
                for j in range(n):
                    yield chunk(j, None, None, role=True)
            while pending and not failed():
                k, j, text, done, ntok = await events.get()
                if (k, j) not in pending:
                    continue
                if done:
                    pending.discard((k, j))
                c = jobs[k].choices[j]
                start = sent.get((k, j), 0)
                end = len(text) if done else len(text) - held_back(text, params.stop)
                if end > start or done:
                    lp = None
                    if params.logprobs is not None:   # the tokens since the last chunk
                        t0, t1 = lp_sent.get((k, j), 0), min(len(c.logprobs), ntok)
                        lp, lp_sent[(k, j)] = _logprobs(server.tok, c, chat, t0, t1), t1
                    sent[(k, j)] = max(start, end)
                    if parsers:
                        for piece in tool_chunks(k, j, text[:max(start, end)], done, lp):
                            yield piece
                        continue
                    piece = text[start:end] if end > start else None
                    if echo.texts:   # the prompt (and its scores) leads the choice's first chunk
                        piece, lp = echo_chunk(server.tok, jobs[k], echo, k, (k, j) not in echoed, piece, lp,
                                               params.logprobs)
                        echoed.add((k, j))
                    yield chunk(k * n + j, piece, c.finish_reason if done else None, lp)
            if failed():
                yield f"data: {json.dumps(_error_body(f'generation failed: {failed()}', kind='server_error'))}\n\n"
            elif not pending:
                server.metrics.answered(arrived, jobs, usage())
            if include_usage:
                yield f"data: {json.dumps({**head, 'choices': [], 'usage': usage()})}\n\n"
            yield "data: [DONE]\n\n"
        finally:   # also when the client disconnects mid-stream: its rows leave the batch
            for job in jobs:
                job.cancel()

    return StreamingResponse(stream(), media_type="text/event-stream")


def _reply(tok, plan: ToolPlan, c: Choice, text: str) -> str:
    """A choice's reply as the model wrote it: the forced opening, the text, and the built-in call end the
    reply stopped at (a stop string, so cut from the text)."""
    closed = plan.stop and c.finish_reason == "stop" and c.tokens and c.tokens[-1] == getattr(tok, "call_end_id", -1)
    return plan.prefix + text + (plan.stop[0] if closed else "")


def _finish(c: Choice, called: bool) -> str | None:
    """OpenAI's finish_reason: "tool_calls" when a reply that ended by itself made calls."""
    return "tool_calls" if called and c.finish_reason == "stop" else c.finish_reason


class RequireKey:
    """ASGI middleware: with `--api-key`, every request but GET /health needs `Authorization: Bearer KEY`
    (vLLM's --api-key guards /v1/*; here the docs pages are guarded too). Checked before the body is
    read, so an unauthenticated client learns nothing about the API, not even a validation error."""

    def __init__(self, app, key: str) -> None:
        self.app, self.key = app, key.encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"] != "/health" and not self._ok(scope):
            body = _error_body("missing or incorrect API key: send the header 'Authorization: Bearer <key>' "
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


def _logprobs(tok, c: Choice, chat: bool, start: int = 0, end: int | None = None):
    """A choice's token log-probs from `start` on, in the completions API's (legacy) or chat's shape."""
    end = len(c.logprobs) if end is None else end
    ids, lps, tops = c.tokens[start:end], c.logprobs[start:end], c.top[start:end]
    piece = [tok.decode([t], skip_special=False) for t in ids]
    if chat:
        return {"content": [{"token": p, "logprob": lp, "bytes": list(p.encode()),
                             "top_logprobs": [{"token": (s := tok.decode([t], skip_special=False)), "logprob": v,
                                               "bytes": list(s.encode())} for t, v in top]}
                            for p, lp, top in zip(piece, lps, tops)]}
    # where each token's text starts in the completion's text: the length of the text decoded before it
    # (decoding token by token would drop a SentencePiece token's leading space)
    offsets = [len(tok.decode(c.tokens[:i])) for i in range(start, end)]
    return legacy_logprobs(tok, ids, lps, tops, offsets)
