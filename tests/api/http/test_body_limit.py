"""Request bodies past `max_request_body_bytes` are refused with 413 before the server holds them, and
bodies slower than `request_body_timeout_s` with 408 (api/http/body_limit.py), against a real server with a
4 KiB / 2 s limit; adapter uploads keep their own limit. Headers slower than `request_header_timeout_s`
(1.5 s here) get 408 too (api/http/header_timeout.py; its own tests: tests/api/http/test_header_timeout.py).

Without the limit, one unauthenticated 400 MiB POST to /v1/completions made the server hold ~825 MB.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.harness.servers import Server, launch_server
from tests.harness.uploads import files_of, peft_adapter, upload

pytestmark = pytest.mark.slow  # real servers

LIMIT = 4096
TIMEOUT_S = 2.0
HEADER_TIMEOUT_S = 1.5
MODEL = "tiny-llama"


@pytest.fixture(scope="module")
def server(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    args = ["--model", str(tiny_llama_dir), "--served-model-name", MODEL, "--max-model-len", "256"]
    args += ["--max-request-body-bytes", str(LIMIT), "--request-body-timeout-s", str(TIMEOUT_S)]
    args += ["--request-header-timeout-s", str(HEADER_TIMEOUT_S)]
    with launch_server(args, tmp_path_factory.mktemp("body") / "data", check_exit=False) as started:
        yield started


@pytest.fixture(scope="module")
def key(server: Server) -> str:
    """A real tenant key: without one the key guard answers 401 before any limit is looked at."""
    return server.tenant("body")[1]


def _rss_kb(server: Server) -> int:
    assert server.process.proc is not None
    status = Path(f"/proc/{server.process.proc.pid}/status").read_text()
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmRSS:")))


def _raw(server: Server, head: str, body_chunks: list[bytes]) -> bytes:
    """Sends a request by hand (a declared length we never send, chunked bodies); returns the reply's
    first bytes."""
    with socket.create_connection(("127.0.0.1", server.process.port), timeout=30) as sock:
        sock.sendall(head.encode())
        try:
            for chunk in body_chunks:
                sock.sendall(chunk)
        except OSError:
            pass  # the server answered and closed while we were still sending: what we test
        reply = b""
        try:
            while chunk := sock.recv(4096):  # the server closes the connection after its answer
                reply += chunk
        except ConnectionResetError:
            pass  # closed with our unread bytes in its buffer: a reset after the answer
        return reply


def _error(reply: bytes) -> tuple[int, dict[str, object]]:
    head, _, body = reply.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)["error"]


def test_a_declared_length_past_the_limit_is_413_before_any_byte_is_read(server: Server, key: str) -> None:
    before = _rss_kb(server)
    head = (
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Authorization: Bearer {key}\r\nContent-Length: {400 << 20}\r\n\r\n"
    )
    status, error = _error(_raw(server, head, []))  # no body: refused on the header alone
    assert status == 413 and error["code"] == "payload_too_large"
    assert f"limit of {LIMIT} bytes" in str(error["message"])
    assert _rss_kb(server) - before < 20_000


def test_a_chunked_body_is_cut_off_once_it_passes_the_limit(server: Server, key: str) -> None:
    head = (
        "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Authorization: Bearer {key}\r\nTransfer-Encoding: chunked\r\n\r\n"
    )
    # No length is declared; 40 KiB in 1 KiB chunks, well within what the server reads off the socket
    # at once (so closing after its answer never resets the connection under it).
    chunk = b"x" * 1024
    chunks = [b"%x\r\n%s\r\n" % (len(chunk), chunk) for _ in range(40)]
    status, error = _error(_raw(server, head, chunks))
    assert status == 413 and error["code"] == "payload_too_large"


def test_a_body_trickling_in_past_the_timeout_is_408(server: Server, key: str) -> None:
    head = (
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Authorization: Bearer {key}\r\nContent-Length: 100\r\n\r\n"
    )
    start = time.monotonic()
    status, error = _error(_raw(server, head, [b'{"model": "tiny']))  # then nothing more
    assert status == 408 and error["code"] == "request_timeout"
    assert TIMEOUT_S <= time.monotonic() - start < TIMEOUT_S + 10


def test_headers_that_stop_arriving_are_408_after_the_header_timeout(server: Server) -> None:
    start = time.monotonic()
    status, error = _error(_raw(server, "POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Slow: a", []))
    assert status == 408 and error["code"] == "request_timeout"
    assert HEADER_TIMEOUT_S * 0.9 <= time.monotonic() - start < HEADER_TIMEOUT_S + 10


def test_bodies_within_the_limit_and_uploads_are_served(server: Server, tmp_path: Path) -> None:
    _, key = server.tenant()
    auth = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    body = json.dumps({"model": MODEL, "prompt": "hello", "max_tokens": 2})
    padded = body + " " * (LIMIT - len(body))  # exactly the limit (JSON allows trailing whitespace)
    r = httpx.post(f"{server.base_url}/v1/completions", headers=auth, content=padded, timeout=60)
    assert r.status_code == 200, r.text
    r = httpx.post(f"{server.base_url}/v1/completions", headers=auth, content=padded + " ", timeout=60)
    assert r.status_code == 413 and r.json()["error"]["code"] == "payload_too_large"
    files = files_of(peft_adapter(tmp_path / "a"))
    assert sum(len(content) for content in files.values()) > LIMIT  # only the upload limit applies
    assert upload(server, key, "big-enough", files).status_code == 201
    r = httpx.post(
        f"{server.base_url}/v1/completions",
        headers=auth,
        json={"model": "big-enough", "prompt": "hi", "max_tokens": 2},
        timeout=60,
    )
    assert r.status_code == 200, r.text
