"""Slow request headers (slowloris): a connection gets `request_header_timeout_s` to deliver a request's
headers, counted from when it opened or its previous response ended.

uvicorn arms no timer until a first response has been sent, and each byte that arrives cancels its
keep-alive timer: a client that connects and sends nothing, or trickles header bytes one at a time,
holds a socket and a file descriptor forever, and a few thousand such clients leave none for anyone
else. Bodies are bounded by api/http/body_limit.py once the headers are in; this covers the part before.

On expiry: a connection that sent part of a request gets 408 `request_timeout` (OpenAI-shaped) and
is closed; an idle one is closed without a reply (an answer on an idle keep-alive connection could be
taken by the client as the answer to a request it is sending at that moment). A connection whose
request is being answered (a long stream, a slow engine) is never touched: the timer runs only while
no request is in progress.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import logging
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol

logger = logging.getLogger(__name__)

_BODY = json.dumps(
    {
        "error": {
            "message": "request headers did not arrive in time; send the whole request promptly",
            "type": "invalid_request_error",
            "param": None,
            "code": "request_timeout",
        }
    }
).encode()
REPLY_408 = (
    b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: close\r\n"
    + b"content-length: %d\r\n\r\n" % len(_BODY)
    + _BODY
)


class HeaderDeadline:
    """Mixin for a uvicorn HTTP protocol: the header deadline runs while no request is in progress."""

    header_timeout_s: float = 20.0
    # Set by uvicorn's protocol classes; declared for the type checker.
    loop: asyncio.AbstractEventLoop
    transport: asyncio.Transport
    cycle: Any

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._header_timer: asyncio.TimerHandle | None = None
        self._header_bytes = 0
        super().connection_made(transport)  # type: ignore[misc]
        self._sync_header_deadline()

    def data_received(self, data: bytes) -> None:
        if self._header_timer is not None:
            self._header_bytes += len(data)
        super().data_received(data)  # type: ignore[misc]
        self._sync_header_deadline()

    def on_response_complete(self) -> None:
        super().on_response_complete()  # type: ignore[misc]
        self._sync_header_deadline()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_header_deadline()
        super().connection_lost(exc)  # type: ignore[misc]

    def _waiting_for_headers(self) -> bool:
        if self.transport.is_closing():
            return False
        return self.cycle is None or bool(self.cycle.response_complete)

    def _sync_header_deadline(self) -> None:
        waiting = self._waiting_for_headers()
        if waiting and self._header_timer is None:
            self._header_bytes = 0
            self._header_timer = self.loop.call_later(self.header_timeout_s, self._header_deadline_passed)
        elif not waiting:
            self._cancel_header_deadline()

    def _cancel_header_deadline(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _header_deadline_passed(self) -> None:
        self._header_timer = None
        if not self._waiting_for_headers():
            return
        if self._header_bytes:
            logger.debug("request headers not complete after %.1f s: 408", self.header_timeout_s)
            self.transport.write(REPLY_408)
        self.transport.close()


class H11HeaderDeadline(HeaderDeadline, H11Protocol):
    pass


def protocol_class(header_timeout_s: float) -> type[asyncio.Protocol]:
    """The HTTP protocol uvicorn would pick (httptools when installed, else h11), with the deadline."""
    base: type[asyncio.Protocol] = H11HeaderDeadline
    if importlib.util.find_spec("httptools") is not None:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

        base = type("HttpToolsHeaderDeadline", (HeaderDeadline, HttpToolsProtocol), {})
    return type(base.__name__, (base,), {"header_timeout_s": header_timeout_s})
