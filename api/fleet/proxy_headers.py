"""One X-Request-Id per response through Ray Serve's HTTP proxy.

Ray's proxy wraps every application in its RequestIdMiddleware, which appends its own `X-Request-ID`
to each response even when the application set one: a client then saw two (httpx joins them into
"cmpl-..., 6f1c..."; OpenAI clients log the pair). Ours is the one that names the request in usage
records and logs, so this middleware, installed around Ray's through the proxy callback
(`RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH`, set by `proxy_env()`), keeps the first one the app
sent and drops the one Ray appended after it. A response our app did not answer (Ray's own 404 or
503) keeps Ray's id.

Ray's middleware also gives every request without an `X-Request-Id` one of its own (a UUID), so behind
it a client's id cannot be told from Ray's. This middleware, outside Ray's, passes the client's own on
as `CLIENT_REQUEST_ID` (one a client sent under that name is dropped): what the ingress makes the
request id of (api/fleet/routing.py).
"""

from __future__ import annotations

from typing import Any

from starlette.middleware import Middleware
from starlette.types import ASGIApp, Message, Receive, Scope, Send

CALLBACK = "api.fleet.proxy_headers:middlewares"
_REQUEST_ID = b"x-request-id"
CLIENT_REQUEST_ID = "x-loraserve-client-request-id"  # the client's X-Request-Id, as it arrived


def proxy_env() -> dict[str, str]:
    """The environment Ray's processes need (set before `ray.init` / `ray start`)."""
    return {"RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH": CALLBACK}


def first_request_id_only(headers: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """`headers` without every X-Request-Id after the first."""
    kept: list[tuple[bytes, bytes]] = []
    seen = False
    for name, value in headers:
        if name.lower() == _REQUEST_ID:
            if seen:
                continue
            seen = True
        kept.append((name, value))
    return kept


class OneRequestId:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_one_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": first_request_id_only(list(message.get("headers", [])))}
            await send(message)

        await self.app({**scope, "headers": with_client_request_id(scope["headers"])}, receive, send_one_id)


def with_client_request_id(headers: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """Request headers with the client's X-Request-Id copied as `CLIENT_REQUEST_ID` (before Ray's
    middleware adds its own to a request without one)."""
    name = CLIENT_REQUEST_ID.encode()
    kept = [(k, v) for k, v in headers if k.lower() != name]
    sent = [v for k, v in kept if k.lower() == _REQUEST_ID]
    return kept + [(name, sent[0])] if sent else kept


def middlewares() -> list[Any]:
    """Ray Serve's HTTP proxy callback: the middlewares to install around its own."""
    return [Middleware(OneRequestId)]
