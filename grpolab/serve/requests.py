"""What the OpenAI-compatible API accepts, and how a request becomes the batcher's jobs.

The request models declare every field the server takes: a field not declared is refused with a 400
naming it, never silently ignored. `Server` holds the app's state (batcher, tokenizer, ceilings) and
turns a validated request into prompts, `SamplingParams` and `Job`s; every mistake is an `APIError`
in OpenAI's error shape.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import threading
from concurrent.futures import ThreadPoolExecutor
from functools import cached_property, partial
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from ..data.messages import canonical_role, role_problem
from ..rollout.structured import BadConstraint, Constraint, Grammars
from .batcher import MAX_LOGPROBS, BadSampling, Batcher, Job, SamplingParams
from .echo import Echo
from .metrics import Metrics
from .tokenize import longest_token_chars, raw_ids
from .tool_calls import (
    ToolPlan,
    ToolRequestError,
    builtin_prompt,
    hf_messages,
    history_calls,
    is_builtin,
    plan_tools,
    tool_support,
)
from .tool_grammar import forced_call

# defaults of `grpolab serve --max-rows-per-request` and `--max-waiting` (rows = prompts × n)
MAX_ROWS_PER_REQUEST = 1024
MAX_WAITING = 4096
# default of `--max-request-bytes`: a 128k-token context as JSON-escaped text (about 3 MB) or token ids
# (about 1 MB), twice over; lm-eval's batched requests are a few hundred KB
MAX_REQUEST_BYTES = 8 * 2**20
# a text longer than SLACK x context x the longest token's characters cannot fit: refused before tokenizing
# (the slack covers normalizers that fold several characters into one)
SLACK = 4



class APIError(Exception):
    def __init__(self, message: str, param: str | None = None, status: int = 400, code: str | None = None,
                 kind: str | None = None, headers: dict | None = None) -> None:
        super().__init__(message)
        self.message, self.param, self.status, self.code = message, param, status, code
        self.kind = kind or ("server_error" if status >= 500 else "invalid_request_error")
        self.headers = headers


class SamplingRequest(BaseModel):
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


class CompletionRequest(SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False
    prompt_logprobs: int | None = None


class ChatRequest(SamplingRequest):
    messages: list[dict[str, Any]] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None


def error_body(message: str, param: str | None = None, code: str | None = None,
                kind: str = "invalid_request_error") -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


# vLLM's structured_outputs keys: one constraint, plus the one option implemented here
_STRUCTURED = {"json": "json", "regex": "regex", "choice": "choice", "grammar": "grammar", "json_object": "json_object"}


def request_constraint(r: SamplingRequest) -> tuple[Constraint | None, str]:
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
                 api_key: str | None = None, max_request_bytes: int = MAX_REQUEST_BYTES) -> None:
        self.batcher, self.tok, self.name, self.context = batcher, tok, name, context
        self.max_rows_per_request, self.max_waiting = max_rows_per_request, max_waiting
        self.max_request_bytes = max_request_bytes
        # the batcher's compiled constraints (a Server without one, for rendering prompts: its own)
        self.grammars = batcher.grammars if batcher is not None else Grammars(tok)
        self.max_chars = SLACK * context * longest_token_chars(tok)   # see check_length
        self.api_key = api_key or None
        self.thread: threading.Thread | None = None
        self.metrics = Metrics(batcher)   # its own registry: two servers in one process count apart
        # one thread turns requests into prompts (tokenizing, chat templates, grammars): a body of a few MB
        # takes seconds to tokenize, which on the event loop would hold every other request, /health too.
        # One, not a pool: requests are prepared in arrival order and the tokenizer is never shared among them
        self.prep = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grpolab-prepare")
        self.preparing = 0   # requests in (or waiting for) that thread; /health reports it

    def start(self) -> None:
        self.thread = threading.Thread(target=self.batcher.run, name="grpolab-batcher", daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.prep.shutdown(wait=True)
        self.batcher.stop()
        if self.thread is not None:
            self.thread.join()

    async def prepared(self, fn, *args):
        """`fn(*args)` run in the preparing thread, awaited from the event loop (its APIError raised here)."""
        self.preparing += 1   # changed on the event loop only
        try:
            return await asyncio.get_running_loop().run_in_executor(self.prep, partial(fn, *args))
        finally:
            self.preparing -= 1

    def completion_request(self, r: CompletionRequest) -> tuple[list[list[int]], Echo, SamplingParams]:
        """A completions request's prompts (ids), what it wants echoed and its sampling settings; the row
        ceiling is checked before anything is tokenized."""
        self._check_model(r.model)
        p = r.prompt   # a list of strings or of id lists is a batch of prompts
        self.check_rows(len(p) if isinstance(p, list) and p and not isinstance(p[0], int) else 1, r.n)
        prompts = self.completion_prompts(r)
        echo = echo_request(self.tok, r, prompts)
        # max_tokens 0 with echo (vLLM's): one token is sampled, as for any request, and not returned
        params = self._params(r, max(len(p) for p in prompts), r.max_tokens if echo.generate else 1, r.logprobs)
        return prompts, echo, params

    def chat_request(self, r: ChatRequest) -> tuple[list[int], SamplingParams, ToolPlan]:
        """A chat request's prompt (ids), sampling settings and tool plan."""
        self._check_model(r.model)
        self.check_rows(1, r.n)
        plan = self.tool_plan(r)
        prompt = self.chat_prompt(r, plan)
        top = (r.top_logprobs or 0) if r.logprobs else None
        params = self._params(r, len(prompt), r.max_completion_tokens or r.max_tokens, top)
        if plan.stop:   # the built-in model's call end: the reply ends at a call, which the client runs
            params = dataclasses.replace(params, stop=params.stop + plan.stop)
        forced = forced_call(self.tok, r.tools or [], r.tool_choice) if plan.parse else None
        if forced is not None:   # the reply is the call: its arguments held to the tool's schema
            if params.constraint is not None:
                raise APIError("response_format and structured_outputs constrain a reply's content, but this "
                               "tool_choice makes the reply a call (held to the tool's parameters schema); "
                               "drop one of them", "tool_choice")
            try:
                self.grammars.compile(forced)
            except BadConstraint as e:
                raise APIError(f"tool_choice: the forced call's grammar does not compile: {e}",
                               "tool_choice") from None
            params = dataclasses.replace(params, constraint=forced)
        if r.logprobs:   # the log-probs' bytes need llguidance's vocabulary (~0.3 s, once): built off the loop
            self.token_bytes([])
        return prompt, params, plan

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

    def token_bytes(self, ids: list[int]) -> list[list[int]]:
        """Each token's raw bytes, as chat log-probs give them: a token holding part of a UTF-8 character
        decodes to the replacement character, whose bytes say nothing of the token's."""
        if hasattr(self.tok, "tok"):   # a Hugging Face tokenizer: its vocabulary's bytes, read by llguidance
            return [list(b) for b in self.grammars.token_bytes(ids)]
        return [list(self.tok.decode([t], skip_special=False).encode()) for t in ids]   # the built-in: characters

    def check_length(self, chars: int, param: str) -> None:
        """A 400 for a text that cannot fit the context whatever it tokenizes to, before tokenizing it (a long
        tokenization would hold the event loop, and every other request, meanwhile)."""
        if chars > self.max_chars:
            raise APIError(f"the {param} is {chars} characters, more than the model's context of {self.context} "
                           f"tokens can hold (at most {self.max_chars} characters); shorten it", param,
                           code="context_length_exceeded")

    def _params(self, r: SamplingRequest, prompt_len: int, max_tokens: int | None,
                logprobs: int | None) -> SamplingParams:
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
        constraint, param = request_constraint(r)
        if constraint is not None:
            try:
                self.grammars.compile(constraint)
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
        for x in ([p] if isinstance(p, str) else p if isinstance(p, list) else []):
            if isinstance(x, str):
                self.check_length(len(x), "prompt")
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

    @cached_property
    def tool_problem(self) -> str | None:
        """Why the model's chat template cannot carry tools (None: it can); checked once, at the first use."""
        return tool_support(self.tok)

    def tool_plan(self, r: ChatRequest) -> ToolPlan:
        """How the request uses tools (tool_calls.plan_tools); a 400 naming the field when it cannot."""
        try:
            plan = plan_tools(self.tok, r.tools, r.tool_choice, self.tool_problem if r.tools else None)
        except ToolRequestError as e:
            raise APIError(str(e), e.param) from None
        for i, t in enumerate(r.tools or []):   # a schema response_format would refuse is refused here too
            params = t["function"].get("parameters")
            if params:
                try:
                    self.grammars.compile(Constraint("json", json.dumps(params)))
                except BadConstraint as e:
                    name = f"tools[{i}].function.parameters"
                    raise APIError(f"{name} (tool {t['function']['name']!r}) is not a usable JSON schema: {e}",
                                   name) from None
        return plan

    def chat_prompt(self, r: ChatRequest, plan: ToolPlan | None = None) -> list[int]:
        """The conversation rendered as training renders it (tools, calls and results included), then the
        text a forced tool_choice makes the reply start with."""
        plan = plan or self.tool_plan(r)
        messages, chars = [], 0
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
            chars += len(content)
            self.check_length(chars, "messages")
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


def echo_request(tok, r: CompletionRequest, prompts: list[list[int]]) -> Echo:
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

