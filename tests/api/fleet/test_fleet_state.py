"""Two real `loraserve serve --fleet` replicas on one PostgreSQL + S3 share their state.

Per-process state made per-fleet: a tenant's rpm and concurrency limits hold once across both
replicas (not twice), and an admin console login made through one works through the other and after
the first restarts. Driven with the official openai client and httpx, as a client behind a load
balancer would; the database is migrated once by `loraserve db upgrade` before the replicas start.
"""

from __future__ import annotations

import json
import socket
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

from api.admin.console.sessions import COOKIE_NAME
from tests.api.admin.console_helpers import csrf_of
from tests.harness.postgres import new_database
from tests.harness.s3 import s3_backend
from tests.harness.servers import ADMIN_KEY, LORASERVE, ServerProcess, main_server_args
from tests.harness.wait import wait_for

pytestmark = pytest.mark.slow  # real servers

MODEL = "tiny-llama"


@pytest.fixture(scope="module")
def replicas(
    tiny_llama_dir: Path, postgres_url: str, s3_server: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[ServerProcess, ServerProcess]]:
    tmp = tmp_path_factory.mktemp("fleet")
    db = new_database(postgres_url)
    s3 = s3_backend(s3_server, tmp)
    aws = {k: v for k, v in s3.items() if k.startswith("AWS_")}
    subprocess.run([LORASERVE, "db", "upgrade", "--db", db], check=True, capture_output=True, timeout=180)
    args = [
        *main_server_args(tiny_llama_dir),
        "--fleet",
        "--db",
        db,
        "--registry",
        f"s3://{s3['bucket']}/registry",
    ]
    servers = [
        ServerProcess(
            args,
            tmp / f"data-{name}",
            env={"LORASERVE_ADMIN_KEY": ADMIN_KEY, "LORASERVE_REPLICA_ID": name, **aws},
        )
        for name in ("a", "b")
    ]
    with ThreadPoolExecutor(2) as pool:  # start both at once
        list(pool.map(ServerProcess.start, servers))
    try:
        yield servers[0], servers[1]
    finally:
        for server in servers:
            server.stop()


def _tenant(server: ServerProcess, **quotas: int) -> str:
    """A new tenant with these quotas; returns its API key."""
    r = httpx.post(
        f"{server.base_url}/admin/api/tenants",
        headers={"Authorization": f"Bearer {ADMIN_KEY}"},
        json={"name": f"f-{uuid.uuid4().hex[:8]}", "quotas": quotas},
        timeout=60,
    )
    assert r.status_code == 201, r.text
    return str(r.json()["api_key"])


def _client(server: ServerProcess, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=key, max_retries=0, timeout=60)


def _ask(client: openai.OpenAI) -> str:
    """ "ok", or the refused limit ("rpm", "max_concurrent") after checking the 429's headers."""
    try:
        client.completions.create(model=MODEL, prompt="hello", max_tokens=1)
        return "ok"
    except openai.RateLimitError as exc:
        assert int(exc.response.headers["retry-after"]) >= 1
        return str(exc.body["param"]) if isinstance(exc.body, dict) else "?"


def test_rpm_limit_holds_across_both_replicas(replicas: tuple[ServerProcess, ServerProcess]) -> None:
    key = _tenant(replicas[0], rpm=10)
    clients = [_client(r, key) for r in replicas]
    started = time.monotonic()
    with ThreadPoolExecutor(4) as pool:  # 20 requests alternating between the replicas
        outcomes = list(pool.map(lambda i: _ask(clients[i % 2]), range(20)))
    elapsed = time.monotonic() - started
    refilled = int(elapsed * 10 / 60)  # the bucket refills continuously: 1 request per 6 s
    assert outcomes.count("ok") == 10 + refilled, (outcomes, elapsed)
    assert outcomes.count("rpm") == 10 - refilled
    assert {outcomes[i] for i in range(0, 20, 2)} & {"ok"} and {outcomes[i] for i in range(1, 20, 2)} & {"ok"}


def _hold_stream(server: ServerProcess, key: str, opened: threading.Event, done: threading.Event) -> None:
    """A streamed request that stays admitted until `done`: its client reads the first bytes, then
    nothing, through a 4 KiB receive buffer, so the server's send blocks on the rest of its large
    stream (16 choices x 240 tokens with 20 logprobs each: megabytes) and the request cannot end."""
    body = json.dumps(
        {
            "model": MODEL,
            "prompt": "hold",
            "max_tokens": 240,
            "n": 16,
            "logprobs": 20,
            "stream": True,
            "ignore_eos": True,
        }
    )
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {key}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connect: no autotuning
        sock.settimeout(60)
        sock.connect(("127.0.0.1", server.port))
        sock.sendall((head + body).encode())
        assert sock.recv(1024).startswith(b"HTTP/1.1 200"), "the holding request was not admitted"
        opened.set()
        done.wait(60)


def test_concurrency_limit_holds_across_both_replicas(replicas: tuple[ServerProcess, ServerProcess]) -> None:
    key = _tenant(replicas[0], max_concurrent=2)
    done = threading.Event()
    opened = [threading.Event(), threading.Event()]
    holders = [
        threading.Thread(target=_hold_stream, args=(server, key, event, done))
        for server, event in zip(replicas, opened, strict=True)
    ]
    for holder in holders:
        holder.start()
    try:
        assert all(event.wait(60) for event in opened)
        assert [_ask(_client(r, key)) for r in replicas] == ["max_concurrent", "max_concurrent"]
    finally:
        done.set()
        for holder in holders:
            holder.join(60)
    # Released slots are written by a background thread: poll.
    wait_for(lambda: _ask(_client(replicas[1], key)) == "ok", 30, interval=0.2, what="the slots come back")


def test_console_login_works_through_the_other_replica_and_after_a_restart(
    replicas: tuple[ServerProcess, ServerProcess],
) -> None:
    a, b = replicas
    r = httpx.post(f"{a.base_url}/admin/login", data={"admin_key": ADMIN_KEY, "next": "/admin"}, timeout=60)
    assert r.status_code == 303, r.text
    cookies = {COOKIE_NAME: r.cookies[COOKIE_NAME]}
    assert httpx.get(f"{b.base_url}/admin/overview.json", cookies=cookies, timeout=60).status_code == 200
    page = httpx.get(
        f"{b.base_url}/admin/tenants", cookies=cookies, headers={"Accept": "text/html"}, timeout=60
    )
    csrf = csrf_of(page.text)
    name = f"c-{uuid.uuid4().hex[:8]}"
    created = httpx.post(
        f"{b.base_url}/admin/tenants", data={"name": name, "csrf_token": csrf}, cookies=cookies, timeout=60
    )
    assert created.status_code == 200 and "new-api-key" in created.text  # CSRF token checked on B
    assert a.stop() == 0
    a.start()
    assert httpx.get(f"{a.base_url}/admin/overview.json", cookies=cookies, timeout=60).status_code == 200
    assert "admin key:       provided by the deploy" in a.log()  # the banner names no file of a replica
    assert not (a.data_dir / "admin.key").exists() and not (a.data_dir / "server-secret").exists()
    stranger = {COOKIE_NAME: "not-a-session"}
    assert httpx.get(f"{a.base_url}/admin/overview.json", cookies=stranger, timeout=60).status_code == 401
