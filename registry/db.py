"""Engine and session helpers, and the one-transaction decorator of the service functions.

SQLAlchemy 2.0 sync engine for any URL (`sqlite:///path`, `postgresql+psycopg://...`). SQLite is
the embedded default; it gets WAL, a busy timeout, foreign keys and `BEGIN IMMEDIATE` (the recipe
in SQLAlchemy's SQLite dialect docs) so that concurrent writers queue on the lock instead of
failing on a read-to-write lock upgrade. PostgreSQL connections get a connect timeout, a statement
timeout, TCP keepalives and a TCP user timeout when asked (`make_engine(..., connect_timeout_s=,
read_timeout_s=)`), so an unreachable or stuck server ends a call with an error instead of holding
its thread forever.
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


def make_engine(
    url: str, *, connect_timeout_s: float | None = None, read_timeout_s: float | None = None, **kwargs: Any
) -> Engine:
    """An Engine for `url`; extra keyword arguments go to `sqlalchemy.create_engine`.

    For PostgreSQL (psycopg/libpq): `connect_timeout_s` bounds connecting; `read_timeout_s` is the
    server's `statement_timeout` and libpq's `tcp_user_timeout` with keepalives, so a statement that
    runs longer, or a connection whose peer stopped acknowledging, ends with an error. SQLite ignores
    both (its waits are the busy timeout)."""
    parsed = make_url(url)
    if parsed.get_backend_name() == "sqlite":
        if parsed.database and parsed.database != ":memory:":
            Path(parsed.database).parent.mkdir(parents=True, exist_ok=True)
        engine = create_engine(url, **kwargs)
        event.listen(engine, "connect", _sqlite_on_connect)
        event.listen(engine, "begin", _sqlite_on_begin)
        return engine
    kwargs.setdefault("pool_pre_ping", True)
    if parsed.get_backend_name() == "postgresql":
        connect_args = dict(kwargs.pop("connect_args", {}))
        if connect_timeout_s is not None:
            connect_args.setdefault("connect_timeout", max(2, math.ceil(connect_timeout_s)))  # libpq: >= 2
        if read_timeout_s is not None:
            keepalive_s = max(1, math.ceil(read_timeout_s / 3))
            connect_args.setdefault("keepalives", 1)
            connect_args.setdefault("keepalives_idle", keepalive_s)
            connect_args.setdefault("keepalives_interval", keepalive_s)
            connect_args.setdefault("keepalives_count", 3)
            connect_args.setdefault("tcp_user_timeout", int(read_timeout_s * 1000))
            # The server ends a statement that runs longer (a slow or lock-bound database).
            connect_args.setdefault("options", f"-c statement_timeout={int(read_timeout_s * 1000)}")
        kwargs["connect_args"] = connect_args
    return create_engine(url, **kwargs)


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
