"""Client-side deadlines for PostgreSQL calls, so a hung server ends a call with an error.

The server's `statement_timeout` ends statements that run long, and TCP keepalives with libpq's
`tcp_user_timeout` end connections whose peer is gone. Neither fires when the server is stuck but its
host's kernel still acknowledges every packet: a stopped (SIGSTOP) or frozen postmaster, a proxy that
stopped forwarding. A call then waits for as long as the hang lasts (measured: 45 s, the length of the
stop). Here every call psycopg makes on a connection (a statement, the pool's liveness ping, a commit,
a rollback) runs under a deadline; past it a watchdog thread shuts the connection's socket down, the
blocked call fails at once with psycopg's `OperationalError` on a broken connection, and SQLAlchemy
treats it as any lost connection (invalidates the pool; the API answers 503 `database_unavailable`).

psycopg's own extension points carry it: a `Connection` subclass (`connect` is a classmethod) whose
`cursor_factory` guards `execute`; SQLAlchemy's `do_connect` event makes the connections, its pool
events say when a connection sits in the pool (the call on it before checkout is the ping).
"""

from __future__ import annotations

import heapq
import itertools
import os
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import psycopg
from sqlalchemy import Engine, event

_IDLE_EXIT_S = 10.0  # the watchdog thread ends after this long with nothing to watch


@dataclass(slots=True)
class _Call:
    fd: int
    is_active: bool = True  # False once the call returned: the socket is never touched again
    is_expired: bool = False


class Watchdog:
    """Shuts down the socket of a call still running at its deadline. Thread-safe; one thread, started
    on demand and ended when idle."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._heap: list[tuple[float, int, _Call]] = []  # (deadline, tie-break, call), earliest first
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None

    @contextmanager
    def deadline(self, fd: int, seconds: float) -> Iterator[_Call]:
        call = _Call(fd)
        entry = (time.monotonic() + seconds, next(self._ids), call)
        with self._cond:
            heapq.heappush(self._heap, entry)
            if self._thread is None:
                self._thread = threading.Thread(target=self._watch, name="pg-deadline", daemon=True)
                self._thread.start()
            elif self._heap[0] is entry:  # earlier than what the watchdog sleeps towards
                self._cond.notify()
        try:
            yield call
        finally:
            with self._cond:  # after this the watchdog cannot shut the socket (its fd may be reused)
                call.is_active = False

    def _watch(self) -> None:
        with self._cond:
            idle_since = time.monotonic()
            while True:
                now = time.monotonic()
                while self._heap and not self._heap[0][2].is_active:
                    heapq.heappop(self._heap)
                if not self._heap:
                    if now - idle_since >= _IDLE_EXIT_S:
                        self._thread = None
                        return
                    self._cond.wait(_IDLE_EXIT_S)
                    continue
                idle_since = now
                due, _, call = self._heap[0]
                if due > now:
                    self._cond.wait(due - now)
                    continue
                heapq.heappop(self._heap)
                call.is_expired = True
                _shut_down(call.fd)


def _shut_down(fd: int) -> None:
    """Wake whatever waits on socket `fd` with end-of-file (a duplicate is shut down and closed, so the
    driver's own descriptor stays valid and is closed by the driver)."""
    try:
        sock = socket.socket(fileno=os.dup(fd))
    except OSError:
        return
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    finally:
        sock.close()


@dataclass(frozen=True, slots=True)
class CallDeadlines:
    call_s: float  # a statement, commit or rollback on a checked-out connection
    ping_s: float  # the pool's liveness ping of a pooled connection (a reconnect follows a failure)
    watchdog: Watchdog


class DeadlineConnection(psycopg.Connection[Any]):
    """A psycopg connection whose calls end by their deadlines (`deadlines`, set right after connect)."""

    deadlines: CallDeadlines | None = None
    is_pooled = False  # sitting in SQLAlchemy's pool: the next call is the pre-ping

    @contextmanager
    def call_deadline(self) -> Iterator[None]:
        d = self.deadlines
        if d is None:
            yield
            return
        seconds = d.ping_s if self.is_pooled else d.call_s
        with d.watchdog.deadline(self.fileno(), seconds) as call:
            try:
                yield
            except psycopg.OperationalError as exc:
                if call.is_expired:
                    raise psycopg.OperationalError(
                        f"no answer from the database within {seconds:g} s"
                    ) from exc
                raise

    def commit(self) -> None:
        with self.call_deadline():
            super().commit()

    def rollback(self) -> None:
        with self.call_deadline():
            super().rollback()


class DeadlineCursor(psycopg.Cursor[Any]):
    def execute(self, *args: Any, **kwargs: Any) -> DeadlineCursor:
        connection = self.connection
        assert isinstance(connection, DeadlineConnection)
        with connection.call_deadline():
            super().execute(*args, **kwargs)
        return self

    def executemany(self, *args: Any, **kwargs: Any) -> None:
        connection = self.connection
        assert isinstance(connection, DeadlineConnection)
        with connection.call_deadline():
            super().executemany(*args, **kwargs)


def install_deadlines(engine: Engine, deadlines: CallDeadlines) -> None:
    """Make `engine` (postgresql+psycopg) open `DeadlineConnection`s bound by `deadlines`."""

    @event.listens_for(engine, "do_connect")
    def _connect(_dialect: Any, _record: Any, cargs: Any, cparams: dict[str, Any]) -> DeadlineConnection:
        connection = DeadlineConnection.connect(*cargs, cursor_factory=DeadlineCursor, **cparams)
        connection.deadlines = deadlines
        return connection

    @event.listens_for(engine.pool, "checkin")
    def _checkin(dbapi_connection: Any, _record: Any) -> None:
        if isinstance(dbapi_connection, DeadlineConnection):
            dbapi_connection.is_pooled = True

    @event.listens_for(engine.pool, "checkout")
    def _checkout(dbapi_connection: Any, _record: Any, _proxy: Any) -> None:
        if isinstance(dbapi_connection, DeadlineConnection):
            dbapi_connection.is_pooled = False
