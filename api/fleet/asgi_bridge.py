"""Serve one HTTP request through an ASGI app in-process and stream the response back as chunks.

A replica runs our normal FastAPI app (api/app.py) without a socket of its own: the ingress hands it
the request (method, path, headers, body) and gets back a `ResponseStart` and then body chunks, which
a Ray streaming handle carries to the ingress as they come (SSE streams end to end). When the caller
goes away (the client disconnected, Ray cancelled the call) the app sees `http.disconnect`, exactly
as under uvicorn, so generation aborts its engine requests (api/inference/running.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger(__name__)

Headers = list[tuple[bytes, bytes]]
_DONE = object()


@dataclass(frozen=True, slots=True)
class HttpRequest:
    method: str
    path: str
    query_string: bytes = b""
    headers: Headers = field(default_factory=list)  # lower-case names, as ASGI has them
    body: bytes = b""
    client: tuple[str, int] | None = None


@dataclass(frozen=True, slots=True)
class ResponseStart:
    status: int
    headers: Headers


def _scope(request: HttpRequest) -> dict[str, Any]:
    return {
        "type": "http",
        # spec 2.3: Starlette's StreamingResponse then listens for http.disconnect while it streams.
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": request.method,
        "scheme": "http",
        "path": request.path,
        "raw_path": request.path.encode(),
        "query_string": request.query_string,
        "root_path": "",
        "headers": request.headers,
        "client": request.client,
        "server": None,
    }


async def stream_asgi(app: Any, request: HttpRequest, *, grace_s: float = 5.0) -> AsyncIterator[Any]:
    """Yields one `ResponseStart`, then the body's non-empty chunks (bytes)."""
    messages: asyncio.Queue[Any] = asyncio.Queue()
    disconnected = asyncio.Event()
    is_body_sent = False

    async def receive() -> dict[str, Any]:
        nonlocal is_body_sent
        if not is_body_sent:
            is_body_sent = True
            return {"type": "http.request", "body": request.body, "more_body": False}
        await disconnected.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        await messages.put(message)

    task = asyncio.create_task(app(_scope(request), receive, send))
    task.add_done_callback(lambda _: messages.put_nowait(_DONE))
    try:
        while True:
            message = await messages.get()
            if message is _DONE:
                task.result()  # the app's own exception, if it raised before finishing the response
                raise RuntimeError("the app ended without completing its response")
            if message["type"] == "http.response.start":
                yield ResponseStart(message["status"], list(message.get("headers", [])))
            elif message["type"] == "http.response.body":
                if message.get("body"):
                    yield message["body"]
                if not message.get("more_body", False):
                    return
    finally:
        disconnected.set()  # the app aborts its engine requests on it (api/inference/running.py)
        if not task.done():
            with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError):
                await asyncio.wait_for(asyncio.shield(task), grace_s)
        if not task.done():
            logger.warning("%s %s did not end %.1f s after disconnect: cancelled", request.method,
                           request.path, grace_s)  # fmt: skip
            task.cancel()
