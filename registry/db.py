"""Engine and session helpers, and the one-transaction decorator of the service functions.

SQLAlchemy 2.0 sync engine for any URL (`sqlite:///path`, `postgresql+psycopg://...`). SQLite is
the embedded default; it gets WAL, a busy timeout, foreign keys and `BEGIN IMMEDIATE` (the recipe
in SQLAlchemy's SQLite dialect docs) so that concurrent writers queue on the lock instead of
failing on a read-to-write lock upgrade. PostgreSQL engines get one bound when asked
(`make_engine(..., timeout_s=)`): a connect timeout, the pool's wait, a statement timeout, TCP
keepalives and a TCP user timeout, and client-side deadlines on every call (registry/pg_deadline.py),
so an unreachable, stuck or stopped server ends a call with an error instead of holding its thread.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any, Concatenate, ParamSpec, TypeVar

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session, sessionmaker

from registry.pg_deadline import CallDeadlines, Watchdog, install_deadlines

P = ParamSpec("P")
R = TypeVar("R")

_SQLITE_BUSY_TIMEOUT_MS = 30_000


def _sqlite_on_connect(dbapi_connection: Any, _record: Any) -> None:
    # Take transaction control away from the sqlite3 module; `_sqlite_on_begin` emits BEGIN.
    dbapi_connection.isolation_level = None
    cursor = dbapi_connection.cursor()
    cursor.execute(f"PRAGMA busy_timeout = {_SQLITE_BUSY_TIMEOUT_MS}")
    cursor.execute("PRAGMA foreign_keys = ON")
    cursor.execute("PRAGMA journal_mode = WAL")
    cursor.close()


def _sqlite_on_begin(conn: Any) -> None:
    # IMMEDIATE takes the write lock at BEGIN, so a transaction that reads then writes waits for
    # other writers (busy_timeout) instead of failing with SQLITE_BUSY mid-transaction.
    conn.exec_driver_sql("BEGIN IMMEDIATE")


def make_engine(url: str, *, timeout_s: float | None = None, **kwargs: Any) -> Engine:
    """An Engine for `url`; extra keyword arguments go to `sqlalchemy.create_engine`.

    For PostgreSQL (psycopg), `timeout_s` bounds how long a caller waits on the database:
    - for a connection: the pool's wait (`pool_timeout`), and the liveness ping of a pooled
      connection plus the reconnect after a failed one together, with room to spare for the rest of
      the request (libpq's connect timeout is whole seconds, at least 2: 5 s -> a 1.5 s ping and a
      2 s connect);
    - for each call on it (a statement, commit or rollback): a client-side deadline, which also ends
      calls to a server that is stopped but still acknowledged by its kernel; the server's own
      `statement_timeout` (0.8 x) ends a merely slow statement first and keeps the connection;
    - TCP keepalives and `tcp_user_timeout`: a peer that stopped acknowledging.
    SQLite ignores it (its waits are the busy timeout)."""
    parsed = make_url(url)
    if parsed.get_backend_name() == "sqlite":
        if parsed.database and parsed.database != ":memory:":
            Path(parsed.database).parent.mkdir(parents=True, exist_ok=True)
        engine = create_engine(url, **kwargs)
        event.listen(engine, "connect", _sqlite_on_connect)
        event.listen(engine, "begin", _sqlite_on_begin)
        return engine
    kwargs.setdefault("pool_pre_ping", True)
    deadlines = None
    if parsed.get_backend_name() == "postgresql" and timeout_s is not None:
        connect_s = max(2, math.floor(timeout_s * 0.4))  # libpq: whole seconds, >= 2
        keepalive_s = max(1, math.ceil(timeout_s / 3))
        connect_args = {
            "connect_timeout": connect_s,
            "keepalives": 1,
            "keepalives_idle": keepalive_s,
            "keepalives_interval": keepalive_s,
            "keepalives_count": 3,
            "tcp_user_timeout": int(timeout_s * 1000),
            "options": f"-c statement_timeout={int(timeout_s * 800)}",
        } | dict(kwargs.pop("connect_args", {}))
        kwargs["connect_args"] = connect_args
        kwargs.setdefault("pool_timeout", timeout_s)
        if parsed.get_driver_name() == "psycopg":
            ping_s = max(0.5, min(timeout_s * 0.3, timeout_s - connect_s))
            deadlines = CallDeadlines(call_s=timeout_s, ping_s=ping_s, watchdog=Watchdog())
    engine = create_engine(url, **kwargs)
    if deadlines is not None:
        install_deadlines(engine, deadlines)
    return engine


def session_factory(engine: Engine) -> sessionmaker[Session]:
    """Sessions that keep loaded attributes after commit (service results are built after it)."""
    return sessionmaker(bind=engine, expire_on_commit=False)


def transactional(fn: Callable[Concatenate[Session, P], R]) -> Callable[Concatenate[Session, P], R]:
    """Make a service function one transaction: commit on return, roll back on error.

    Reads commit too, so no lock (SQLite) or snapshot (PostgreSQL) outlives the call even when the
    caller keeps its session open, e.g. for the length of a streamed response.
    """

    @functools.wraps(fn)
    def wrapper(session: Session, /, *args: P.args, **kwargs: P.kwargs) -> R:
        try:
            result = fn(session, *args, **kwargs)
            session.commit()
        except BaseException:
            session.rollback()
            raise
        return result

    return wrapper
