"""The request body ceiling (`grpolab serve --max-request-bytes`): ASGI middleware that answers 413 before a
body larger than the limit is read whole, so a 150 MB prompt costs the server a header check (Content-Length)
or at most `limit` bytes of buffering (a chunked body), never its parse, tokenization or memory, and no other
request waits behind it."""

from __future__ import annotations

from fastapi.responses import JSONResponse

from .requests import error_body


def _too_large(limit: int, size: str) -> JSONResponse:
    return JSONResponse(error_body(f"request body too large: {size}, over this server's limit of {limit} bytes "
                                   f"(--max-request-bytes); send a shorter prompt or split the request",
                                   code="request_too_large"), status_code=413)


class LimitBody:
    """Refuses HTTP requests whose body exceeds `limit` bytes; the rest reach `app` with their body as sent."""

    def __init__(self, app, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.strip().isdigit() and int(declared) > self.limit:
            await _too_large(self.limit, f"{int(declared)} bytes")(scope, receive, send)
            return
        # no (or a smaller) Content-Length: read up to the limit, then hand the body on as it came
        messages, size = [], 0
        while True:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":   # the client left
                break
            size += len(message.get("body", b""))
            if size > self.limit:
                await _too_large(self.limit, f"more than {self.limit} bytes")(scope, receive, send)
                return
            if not message.get("more_body", False):
                break
        pending = iter(messages)

        async def replay():
            return next(pending, None) or await receive()

        await self.app(scope, replay, send)
