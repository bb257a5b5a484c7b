"""Slow dependencies end in errors within their configured bounds (a hung S3 once held threads
for minutes): the S3 store behind a proxy that stops answering, PostgreSQL that never answers a
connection, and a statement that runs longer than the read timeout."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from sqlalchemy import text
from sqlalchemy.exc import OperationalError

from registry.db import make_engine
from registry.errors import StoreUnavailable
from registry.s3 import S3Store
from tests.harness.hanging_proxy import HangingProxy
from tests.harness.wait import wait_for


@pytest.mark.slow
def test_s3_calls_end_within_their_timeouts_when_the_endpoint_hangs(
    s3_bucket: str, s3_server: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    with HangingProxy(s3_server) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
        store = S3Store(bucket=s3_bucket, prefix="p", max_attempts=2, connect_timeout_s=1, read_timeout_s=1)
        src = tmp_path / "blob"
        src.write_bytes(b"x" * 1000)
        store.put("k", src)  # answering: works through the proxy
        assert store.exists("k")
        proxy.hang()
        for call in (store.check, lambda: store.exists("k"), lambda: store.put("k2", src)):
            start = time.monotonic()
            with pytest.raises(StoreUnavailable, match="cannot reach"):
                call()
            # 2 attempts x (1 s read timeout, 1 s waiting for "100 Continue" on a put) plus backoff:
            # never the old 5 attempts x 60 s
            assert time.monotonic() - start < 10, call
        proxy.resume()
        deadline = time.monotonic() + 10
        while True:  # pooled connections that hung are dropped; new ones work again
            try:
                assert store.exists("k")
                break
            except StoreUnavailable:
                assert time.monotonic() < deadline
                time.sleep(0.2)


def test_postgres_connect_times_out_on_a_server_that_never_answers() -> None:
    with HangingProxy("http://127.0.0.1:9") as proxy:  # accepts, never answers (upstream unused)
        proxy.hang()
        port = proxy.url.rsplit(":", 1)[1]
        engine = make_engine(f"postgresql+psycopg://postgres@127.0.0.1:{port}/postgres", timeout_s=2)
        start = time.monotonic()
        with pytest.raises(OperationalError), engine.connect():
            pass
        assert time.monotonic() - start < 6
        engine.dispose()


def test_postgres_statement_longer_than_the_read_timeout_is_cancelled(postgres_url: str) -> None:
    engine = make_engine(postgres_url, timeout_s=1)
    try:
        with engine.connect() as conn:
            assert conn.execute(text("SELECT 1")).scalar() == 1
            start = time.monotonic()
            with pytest.raises(OperationalError, match="statement timeout"):
                conn.execute(text("SELECT pg_sleep(5)"))
            assert time.monotonic() - start < 3
    finally:
        engine.dispose()


def _ends_within(fn: Callable[[], object], seconds: float) -> BaseException | None:
    """What `fn()` raised, run in a daemon thread; fails if it is still running after `seconds`."""
    outcome: list[BaseException | None] = []

    def run() -> None:
        try:
            fn()
            outcome.append(None)
        except BaseException as exc:  # noqa: BLE001 - handed back to the test
            outcome.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"still waiting on the database after {seconds} s"
    return outcome[0]


@pytest.mark.slow
def test_calls_to_a_stopped_postgres_end_within_the_timeout(postgres_url: str) -> None:
    """A server that stops answering while its kernel still acknowledges (SIGSTOP; here a proxy that
    swallows everything): a statement in flight, a commit, and a new checkout (pre-ping of a pooled
    connection, then a reconnect) each end with OperationalError within `timeout_s`."""
    host_port = postgres_url.split("@", 1)[1].split("/", 1)[0]
    with HangingProxy(host_port) as proxy:
        engine = make_engine(postgres_url.replace(host_port, proxy.url.removeprefix("http://")), timeout_s=3)
        try:
            with engine.connect() as conn:
                assert conn.execute(text("SELECT 1")).scalar() == 1
            in_flight = engine.connect()
            in_flight.execute(text("SELECT 1"))  # a transaction open on a checked-out connection
            proxy.hang()
            for call in (
                lambda: in_flight.execute(text("SELECT 2")),
                lambda: engine.connect().execute(text("SELECT 3")),
            ):
                start = time.monotonic()
                error = _ends_within(call, 6)
                assert isinstance(error, OperationalError), error
                assert time.monotonic() - start < 3.6
            proxy.resume()

            def answers() -> bool:
                try:
                    with engine.connect() as conn:
                        return conn.execute(text("SELECT 1")).scalar() == 1
                except OperationalError:
                    return False

            wait_for(answers, 10, interval=0.2, what="answers again")
        finally:
            proxy.resume()
            engine.dispose()
