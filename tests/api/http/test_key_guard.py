"""Keys are checked before bodies: a request with a missing, malformed or forged key (or a wrong admin
key) to a route that takes a body gets its 401 without one `receive` call, so no body is read or
parsed; a forged key costs one database lookup however often it is sent; a real key goes on to
the route.

Driven at the ASGI level on the real app (SQLite registry), so "the body was never read" is an
observation of the `receive` channel, not a timing.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI

from api.app import create_app
from api.bootstrap import build_state
from api.settings import Settings
from api.state import AppState
from registry.tenants import create_tenant

ADMIN = "lsa-key-guard-admin"
FORGED = "lsk-0123456789ab-" + "x" * 43
BODY = json.dumps({"model": "m", "prompt": "hi " * 1000, "max_tokens": 1}).encode()


@pytest.fixture(scope="module")
def app_state(
    tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[FastAPI, AppState]]:
    settings = Settings(
        model=tiny_llama_dir, data_dir=tmp_path_factory.mktemp("guard"), admin_key=ADMIN,
        num_kv_blocks=32, max_model_len=128,
    )  # fmt: skip
    state = build_state(settings)
    try:
        yield create_app(state), state
    finally:
        state.pools.shutdown()


async def _call(
    app: FastAPI, method: str, path: str, key: str | None
) -> tuple[int, dict[str, Any], int, dict]:
    """(status, JSON body, number of receive calls, response headers) of one request to `app`."""
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(BODY)).encode())]
    if key is not None:
        headers.append((b"authorization", f"Bearer {key}".encode()))
    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method, "path": path,
        "raw_path": path.encode(), "root_path": "", "scheme": "http", "query_string": b"", "headers": headers,
        "client": ("127.0.0.1", 5000), "server": ("127.0.0.1", 8000),
    }  # fmt: skip
    received = 0
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        nonlocal received
        received += 1
        if received == 1:
            return {"type": "http.request", "body": BODY, "more_body": False}
        await asyncio.sleep(3600)  # the client stays connected
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    await asyncio.wait_for(app(scope, receive, send), 60)
    start = next(m for m in sent if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    response_headers = {k.decode().lower(): v.decode() for k, v in start["headers"]}
    return start["status"], json.loads(body or b"{}"), received, response_headers


@pytest.mark.parametrize(
    ("path", "key", "code"),
    [
        ("/v1/chat/completions", None, "missing_api_key"),
        ("/v1/chat/completions", "sk-not-ours", "invalid_api_key"),
        ("/v1/completions", FORGED, "invalid_api_key"),
        ("/tokenize", FORGED, "invalid_api_key"),
        ("/admin/api/tenants", "lsa-wrong", "invalid_admin_key"),
    ],
)
def test_refused_keys_never_read_the_body(app_state, path: str, key: str | None, code: str) -> None:
    app, _ = app_state
    status, body, received, headers = asyncio.run(_call(app, "POST", path, key))
    assert status == 401 and body["error"]["code"] == code, body
    assert received == 0, "the body was read before the key was refused"
    assert headers["connection"] == "close"  # the unread body leaves the connection unusable


def test_a_forged_key_costs_one_lookup_however_often_it_is_sent(app_state) -> None:
    app, state = app_state
    forged = "lsk-ba9876543210-" + "y" * 43
    before = state.key_precheck.num_lookups

    async def flood() -> list[tuple[int, dict[str, Any], int, dict]]:
        return await asyncio.gather(*(_call(app, "POST", "/v1/chat/completions", forged) for _ in range(30)))

    results = asyncio.run(flood())
    assert {(status, received) for status, _, received, _ in results} == {(401, 0)}
    assert state.key_precheck.num_lookups == before + 1
    asyncio.run(_call(app, "POST", "/v1/chat/completions", "lsk-nothex-at-all"))  # malformed: no lookup
    assert state.key_precheck.num_lookups == before + 1


def test_a_real_key_reaches_the_route(app_state) -> None:
    app, state = app_state
    with state.sessions() as session:
        _, key = create_tenant(session, name="guard-ok")
    # The route reads the body and answers (its model does not exist: a 404 from the route itself).
    status, body, received, _ = asyncio.run(_call(app, "POST", "/v1/completions", key))
    assert received >= 1 and status == 404, body
    assert body["error"]["code"] == "model_not_found"
