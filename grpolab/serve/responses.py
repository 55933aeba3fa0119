"""The answer to a completions or chat request: one JSON body once every choice is done, or a stream
of server-sent events (a chunk per new piece of text, tool calls as `delta.tool_calls`, an optional
usage chunk, then [DONE]). A client that disconnects cancels its jobs, so its rows leave the batch.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid

from fastapi import Request
from fastapi.responses import StreamingResponse

from .batcher import Choice, SamplingParams, held_back
from .echo import Echo, completion_choice, echo_chunk, legacy_logprobs
from .requests import APIError, SamplingRequest, Server, error_body
from .tool_calls import ToolPlan, new_call_id, parse_reply


async def respond(server: Server, r: SamplingRequest, prompts: list[list[int]], params: SamplingParams, chat: bool,
                  request: Request, echo: Echo | None = None, start: float | None = None,
                  plan: ToolPlan | None = None) -> dict | StreamingResponse:
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
                    choice["logprobs"] = _logprobs(server, c, chat) if params.logprobs is not None else None
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
                        lp, lp_sent[(k, j)] = _logprobs(server, c, chat, t0, t1), t1
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
                yield f"data: {json.dumps(error_body(f'generation failed: {failed()}', kind='server_error'))}\n\n"
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


def _logprobs(server: Server, c: Choice, chat: bool, start: int = 0, end: int | None = None):
    """A choice's token log-probs from `start` on, in the completions API's (legacy) or chat's shape."""
    tok = server.tok
    end = len(c.logprobs) if end is None else end
    ids, lps, tops = c.tokens[start:end], c.logprobs[start:end], c.top[start:end]
    piece = [tok.decode([t], skip_special=False) for t in ids]
    if chat:
        raw = server.token_bytes(ids)
        return {"content": [{"token": p, "logprob": lp, "bytes": b,
                             "top_logprobs": [{"token": tok.decode([t], skip_special=False), "logprob": v,
                                               "bytes": tb} for (t, v), tb in zip(top, server.token_bytes(
                                                   [t for t, _ in top]))]}
                            for p, lp, top, b in zip(piece, lps, tops, raw)]}
    # where each token's text starts in the completion's text: the length of the text decoded before it
    # (decoding token by token would drop a SentencePiece token's leading space)
    offsets = [len(tok.decode(c.tokens[:i])) for i in range(start, end)]
    return legacy_logprobs(tok, ids, lps, tops, offsets)
