"""`BodyLimit`: an ASGI middleware that answers 413 to a request body over a size, before the app
reads it, so that no client makes `triton-vlm openai` buffer and parse gigabytes of JSON.

A body announced too large (Content-Length) is refused before a byte of it is read; one that
arrives in chunks is counted as it comes and refused at the chunk that crosses the limit (the app
sees a disconnect, and what it answers then is dropped).
"""
from __future__ import annotations

import json
from typing import Any, Awaitable, Callable

from triton_vlm.contract.limits import Limits

Scope = dict[str, Any]
Message = dict[str, Any]
ASGIApp = Callable[[Scope, Callable[[], Awaitable[Message]], Callable[[Message], Awaitable[None]]], Awaitable[None]]
# Room for the messages' text and the JSON around the media.
TEXT_BYTES = 1 << 20


def body_limit_bytes(limits: Limits) -> int:
    """The largest body worth reading: every media byte the ensemble accepts in one request
    (`max_request_bytes`), as base64 text, and `TEXT_BYTES` more."""
    return -(-limits.max_request_bytes // 3) * 4 + TEXT_BYTES


class BodyLimit:
    """Wraps `app`; `max_bytes()` is read per request (it may be learnt after start-up)."""

    def __init__(self, app: ASGIApp, max_bytes: Callable[[], int]) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.max_bytes()
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            await _refuse(send, limit)
            return
        received, refused = 0, False

        async def counted() -> Message:
            nonlocal received, refused
            if refused:
                return {"type": "http.disconnect"}
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    refused = True
                    await _refuse(send, limit)
                    return {"type": "http.disconnect"}
            return message

        async def unless_refused(message: Message) -> None:
            if not refused:
                await send(message)

        await self.app(scope, counted, unless_refused)


async def _refuse(send, limit: int) -> None:
    body = json.dumps({"error": {"message": f"request body exceeds {limit} bytes (the media limits of the served "
                                            "ensemble, as base64, and 1 MiB of text)",
                                 "type": "invalid_request_error", "param": None, "code": "request_too_large"}}).encode()
    await send({"type": "http.response.start", "status": 413,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})
