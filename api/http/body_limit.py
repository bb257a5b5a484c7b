"""A ceiling on request bodies, enforced before the app reads one.

FastAPI reads a JSON body whole, before authentication runs, and parses it into Python objects (a
list of token ids grows about six-fold). Without a ceiling anyone, with or without a key, could make
the shared process hold hundreds of megabytes per request (measured: one unauthenticated 400 MiB
POST to /v1/completions raised the server's RSS by 825 MB before its 400) and bring it down for
every tenant. `BodyLimit` refuses a body over `max_bytes` with 413 `payload_too_large`: at once when
its Content-Length says so (nothing is read), else as soon as the bytes received pass the limit
(chunked bodies). A body that has not fully arrived within `request_body_timeout_s` is 408
`request_timeout` (a client trickling bytes would otherwise hold its connection and buffer for as long
as it likes). The body is buffered here and handed to the app unchanged; messages after it (the
client's disconnect) pass through, so disconnect detection works as before.

Adapter uploads (`POST /v1/adapters`) stream their multipart body to disk under their own, larger
limit (api/tenant_adapters/uploads.py) and are left alone. The default (`max_request_body_bytes`, 8 MiB)
admits any
legal request at the longest context (a 128k-token prompt is about 1 MB as text or as token ids).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api.errors import APIError

STREAMED_UPLOADS = frozenset({("POST", "/v1/adapters")})  # bounded by api/tenant_adapters/uploads.py instead


def too_large(max_bytes: int) -> APIError:
    return APIError(
        413,
        f"The request body exceeds this server's limit of {max_bytes} bytes.",
        code="payload_too_large",
    )


def too_slow(timeout_s: float) -> APIError:
    return APIError(
        408,
        f"The request body did not arrive within {timeout_s:g} s.",
        code="request_timeout",
    )


def declared_length(headers: list[tuple[bytes, bytes]]) -> int | None:
    """The Content-Length a request declares (None when absent or not a number: the server decides)."""
    for name, value in headers:
        if name.lower() == b"content-length":
            return int(value) if value.strip().isdigit() else None
    return None


async def read_body(
    headers: list[tuple[bytes, bytes]],
    receive: Callable[[], Awaitable[Message]],
    max_bytes: int,
    timeout_s: float,
) -> bytes | None:
    """The whole body, or None when the client left first. Raises APIError 413 past `max_bytes` (before
    reading anything when the declared Content-Length already says so), 408 past `timeout_s`."""
    declared = declared_length(headers)
    if declared is not None and declared > max_bytes:
        raise too_large(max_bytes)
    try:
        async with asyncio.timeout(timeout_s):
            return await _read_chunks(receive, max_bytes)
    except TimeoutError:
        raise too_slow(timeout_s) from None


async def _read_chunks(receive: Callable[[], Awaitable[Message]], max_bytes: int) -> bytes | None:
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        body = message.get("body", b"")
        size += len(body)
        if size > max_bytes:
            raise too_large(max_bytes)
        chunks.append(body)
        if not message.get("more_body", False):
            return b"".join(chunks)


class BodyLimit:
    def __init__(self, app: ASGIApp, max_bytes: int, timeout_s: float) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.timeout_s = timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or (scope["method"], scope["path"]) in STREAMED_UPLOADS:
            await self.app(scope, receive, send)
            return
        try:
            body = await read_body(scope["headers"], receive, self.max_bytes, self.timeout_s)
        except APIError as exc:
            # The rest of the body is never read: the connection cannot be reused.
            await exc.response({"Connection": "close"})(scope, receive, send)
            return
        if body is None:
            return  # gone before its body arrived: nothing to answer
        await self.app(scope, _replay(body, receive), send)


def _replay(body: bytes, receive: Receive) -> Callable[[], Awaitable[Any]]:
    is_sent = False

    async def replay() -> Message:
        nonlocal is_sent
        if not is_sent:
            is_sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()  # after the body: the client's disconnect, as the server reports it

    return replay
