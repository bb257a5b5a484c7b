"""Slow request headers (api/http/header_timeout.py) on both of uvicorn's HTTP implementations, on a real
uvicorn server over TCP: an idle or trickling connection is closed after the header deadline, a long
answer is never cut by it, and the deadline starts again after each response on a keep-alive
connection. Without the deadline uvicorn keeps such connections forever (these tests then time out).
And `serve` raises the soft open-files limit, so that idle connections cannot use up descriptors early.
The `serve` wiring (--request-header-timeout-s) is checked in tests/api/http/test_body_limit.py."""

from __future__ import annotations

import asyncio
import json
import resource
import select
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import uvicorn

from api.http.header_timeout import H11HeaderDeadline, protocol_class
from tests.harness.servers import free_port

ROOT = Path(__file__).resolve().parents[3]
DEADLINE_S = 1.0
GET = b"GET / HTTP/1.1\r\nHost: test\r\n\r\n"


async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] != "http":
        return
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
    if scope["path"] == "/slow":  # an answer that takes 3 deadlines: a long stream must not be cut
        for _ in range(4):
            await send({"type": "http.response.body", "body": b"tick\n", "more_body": True})
            await asyncio.sleep(DEADLINE_S * 0.75)
    await send({"type": "http.response.body", "body": b"done\n"})


@pytest.fixture(params=["h11", "httptools"])
def port(request: pytest.FixtureRequest) -> Iterator[int]:
    if request.param == "h11":
        http: type[asyncio.Protocol] = type("H11", (H11HeaderDeadline,), {"header_timeout_s": DEADLINE_S})
    else:
        http = protocol_class(DEADLINE_S)
        assert "HttpTools" in http.__name__
    number = free_port()
    config = uvicorn.Config(
        app, host="127.0.0.1", port=number, http=http, log_config=None, timeout_keep_alive=60
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.02)
    try:
        yield number
    finally:
        server.should_exit = True
        thread.join(10)


def _connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=10)


def _read_until_closed(sock: socket.socket) -> bytes:
    reply = b""
    while chunk := sock.recv(4096):
        reply += chunk
    return reply


def _read_response(sock: socket.socket) -> bytes:
    """One chunked response (the test app's), read to its last chunk."""
    reply = b""
    while not reply.endswith(b"0\r\n\r\n"):
        chunk = sock.recv(4096)
        assert chunk, f"closed mid-response: {reply!r}"
        reply += chunk
    return reply


def _trickle(sock: socket.socket, head: bytes) -> bytes:
    """Sends the head a byte every 50 ms, for at most 10 deadlines, until the server answers or closes;
    returns what it answered."""
    stop = time.monotonic() + DEADLINE_S * 10
    for byte in head:
        readable, _, _ = select.select([sock], [], [], 0.05)
        if readable or time.monotonic() > stop:
            break
        try:
            sock.sendall(bytes([byte]))
        except OSError:
            break  # closed while we were sending
    try:
        return _read_until_closed(sock)
    except ConnectionResetError:
        return b""


def test_idle_connection_is_closed_without_a_reply(port: int) -> None:
    with _connect(port) as sock:
        start = time.monotonic()
        assert _read_until_closed(sock) == b""
        assert DEADLINE_S * 0.9 <= time.monotonic() - start < DEADLINE_S + 5


def test_partial_headers_get_408_then_close(port: int) -> None:
    with _connect(port) as sock:
        sock.sendall(b"GET / HTTP/1.1\r\nHost: test\r\nX-Slow: a")
        start = time.monotonic()
        reply = _read_until_closed(sock)
        assert DEADLINE_S * 0.9 <= time.monotonic() - start < DEADLINE_S + 5
    _assert_408(reply)


def test_trickling_bytes_does_not_extend_the_deadline(port: int) -> None:
    with _connect(port) as sock:
        start = time.monotonic()
        reply = _trickle(sock, b"GET / HTTP/1.1\r\nHost: test\r\nX-Slow: " + b"a" * 200)
        assert time.monotonic() - start < DEADLINE_S + 5
    # A byte of ours still in flight when the server closes makes its kernel reset the connection, and
    # ours may then drop the 408 it had received: either way the connection ended at the deadline.
    if reply:
        _assert_408(reply)


def _assert_408(reply: bytes) -> None:
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408 "), reply
    assert b"connection: close" in head.lower()
    assert json.loads(body)["error"]["code"] == "request_timeout"


def test_a_long_answer_is_not_cut(port: int) -> None:
    with _connect(port) as sock:
        sock.sendall(b"GET /slow HTTP/1.1\r\nHost: test\r\n\r\n")
        reply = _read_response(sock)
    assert reply.startswith(b"HTTP/1.1 200 ") and reply.count(b"tick") == 4 and b"done" in reply


def test_deadline_starts_again_after_each_response(port: int) -> None:
    with _connect(port) as sock:
        for _ in range(3):  # prompt requests on one connection, spaced by less than the deadline
            sock.sendall(GET)
            assert _read_response(sock).startswith(b"HTTP/1.1 200 ")
            time.sleep(DEADLINE_S / 10)
        sock.sendall(b"GET /slow HTTP/1.1\r\nHost: test\r\n\r\n")  # longer than the deadline
        assert _read_response(sock).count(b"tick") == 4
        time.sleep(DEADLINE_S / 10)
        sock.sendall(GET)  # the deadline counts from the end of the previous answer, not from before it
        assert _read_response(sock).startswith(b"HTTP/1.1 200 ")
        sock.sendall(GET[:-2])  # all but the blank line that ends the headers
        _assert_408(_read_until_closed(sock))


@pytest.mark.slow
def test_the_open_files_limit_is_raised_to_the_hard_limit() -> None:
    code = (
        "import resource\n"
        "soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 64), hard))\n"
        "from api.server import raise_open_file_limit\n"
        "print(raise_open_file_limit(), resource.getrlimit(resource.RLIMIT_NOFILE)[0], hard)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120, cwd=ROOT
    )
    returned, soft, hard = (int(word) for word in out.stdout.split())
    wanted = 65536 if hard == resource.RLIM_INFINITY else min(hard, 65536)
    assert returned == soft == wanted
