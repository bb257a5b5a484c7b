"""Alembic run in-process: upgrade, downgrade, and the check that a database is at head.

Servers and tests call these instead of the `alembic` command (migrations/alembic.ini is for writing
new revisions by hand). On PostgreSQL `upgrade` holds an advisory lock, so concurrent upgrades of one
database queue; a fleet replica never migrates, it only checks (`check_at_head`).
"""

from __future__ import annotations

import logging
from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import text
from sqlalchemy.engine import make_url
from sqlalchemy.pool import NullPool

from registry.db import make_engine

logger = logging.getLogger(__name__)

SCRIPT_LOCATION = Path(__file__).parent  # env.py and versions/
# pg_advisory_lock key held while migrations run: any fixed bigint; this one is b"LoRaMigr".
MIGRATION_LOCK_KEY = int.from_bytes(b"LoRaMigr")


def alembic_config(url: str) -> Config:
    """Alembic configuration pointing at this package's revisions, for `url`."""
    config = Config()
    config.set_main_option("script_location", str(SCRIPT_LOCATION))
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
    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            return MigrationContext.configure(conn).get_current_revision()
    finally:
        engine.dispose()
