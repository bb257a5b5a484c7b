"""Engine and session helpers, and Alembic upgrade/downgrade run in-process.

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
import logging
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any, Concatenate, ParamSpec, TypeVar

from alembic import command
from alembic.config import Config
from sqlalchemy import Engine, create_engine, event, text
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session, sessionmaker
from sqlalchemy.pool import NullPool

logger = logging.getLogger(__name__)
P = ParamSpec("P")
R = TypeVar("R")

_SQLITE_BUSY_TIMEOUT_MS = 30_000
# pg_advisory_lock key held while migrations run: any fixed bigint; this one is b"LoRaMigr".
MIGRATION_LOCK_KEY = int.from_bytes(b"LoRaMigr")


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


def alembic_config(url: str) -> Config:
    """Alembic configuration pointing at the `migrations` package, for `url`."""
    import migrations

    config = Config()
    config.set_main_option("script_location", str(Path(migrations.__file__).parent))
    config.set_main_option("file_template", "%%(year)d_%%(month).2d_%%(day).2d_%%(rev)s_%%(slug)s")
    # Passed as an attribute, not an ini option: ini values would %-interpolate passwords.
    config.attributes["url"] = url
    return config


def upgrade(url: str, revision: str = "head") -> None:
    """Apply migrations up to `revision` (default: the newest) on the database at `url`.

    On PostgreSQL the run holds a session-level advisory lock (`MIGRATION_LOCK_KEY`) on a connection
    of its own, so concurrent upgrades of one database (two deploy jobs, two replicas started by
    hand) queue: the first migrates, the next finds the schema already at head and does nothing."""
    logger.info("upgrading database %s to %s", make_url(url).render_as_string(hide_password=True), revision)
    if make_url(url).get_backend_name() != "postgresql":
        command.upgrade(alembic_config(url), revision)  # SQLite: BEGIN IMMEDIATE serializes writers
        return
    engine = make_engine(url, poolclass=NullPool)
    try:
        with engine.connect() as lock_conn:
            lock_conn.execute(text("SELECT pg_advisory_lock(:key)"), {"key": MIGRATION_LOCK_KEY})
            lock_conn.commit()  # the lock is the session's, not the transaction's: it outlives this
            try:
                command.upgrade(alembic_config(url), revision)
            finally:
                lock_conn.execute(text("SELECT pg_advisory_unlock(:key)"), {"key": MIGRATION_LOCK_KEY})
                lock_conn.commit()
    finally:
        engine.dispose()


class SchemaNotAtHead(RuntimeError):
    """The database is not at the newest revision this code knows (never migrated, or behind)."""

    def __init__(self, current: str | None, head: str | None) -> None:
        self.current = current
        self.head = head
        at = current or "none (never migrated)"
        super().__init__(f"database schema is at revision {at}, expected {head}")


def head_revision(url: str) -> str | None:
    """The newest revision in `migrations/versions`."""
    from alembic.script import ScriptDirectory

    return ScriptDirectory.from_config(alembic_config(url)).get_current_head()


def check_at_head(url: str) -> None:
    """Raise SchemaNotAtHead unless the database at `url` is at the newest revision (no writes)."""
    current, head = current_revision(url), head_revision(url)
    if current != head:
        raise SchemaNotAtHead(current, head)


def downgrade(url: str, revision: str = "base") -> None:
    """Revert migrations down to `revision` (default: an empty schema)."""
    logger.info("downgrading database %s to %s", make_url(url).render_as_string(hide_password=True), revision)
    command.downgrade(alembic_config(url), revision)


def current_revision(url: str) -> str | None:
    """The revision the database at `url` is at, or None when it has never been migrated."""
    from alembic.runtime.migration import MigrationContext

    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            return MigrationContext.configure(conn).get_current_revision()
    finally:
        engine.dispose()


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
