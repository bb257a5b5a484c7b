"""Alembic environment: runs registry revisions against `registry.tables.metadata` (every table).

The URL comes from `config.attributes["url"]` (set by `migrations.api.upgrade`), else from
`-x url=...`, else from `sqlalchemy.url` in alembic.ini. SQLite runs in batch mode so that later
ALTERs work there too.
"""

from __future__ import annotations

from alembic import context

from registry.db import make_engine
from registry.tables import metadata

target_metadata = metadata


def _url() -> str:
    config = context.config
    url = config.attributes.get("url") or context.get_x_argument(as_dictionary=True).get("url")
    url = url or config.get_main_option("sqlalchemy.url")
    if not url:
        raise ValueError("no database URL: pass -x url=... or set sqlalchemy.url")
    return str(url)


def run_migrations_offline() -> None:
    """Emit SQL to stdout instead of running it (`alembic upgrade --sql`)."""
    context.configure(url=_url(), target_metadata=target_metadata, literal_binds=True, render_as_batch=True)
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    engine = make_engine(_url())
    try:
        with engine.connect() as connection:
            context.configure(
                connection=connection,
                target_metadata=target_metadata,
                render_as_batch=connection.dialect.name == "sqlite",
                compare_type=True,
            )
            with context.begin_transaction():
                context.run_migrations()
    finally:
        engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
