"""Alembic: a fresh database upgrades to head matching the models exactly, and downgrades to empty."""

from __future__ import annotations

import re
from pathlib import Path

from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import inspect

import migrations
from migrations.api import alembic_config, current_revision, downgrade, upgrade
from registry.db import make_engine
from registry.tables import metadata

TABLES = {"tenants", "api_keys", "adapter_versions", "usage_records", "audit_log"}
TABLES |= {"quota_buckets", "quota_leases", "console_sessions"}  # fleet state (0003)
TABLES |= {"fleet_replicas", "fleet_pins", "fleet_events"}  # fleet membership (0004)
TABLES |= {"import_grants", "import_claims"}  # per-tenant imports (0006)
TABLES |= {"stored_responses"}  # Responses API store: true (0010)


def _tables(url: str) -> set[str]:
    engine = make_engine(url)
    try:
        return set(inspect(engine).get_table_names()) - {"alembic_version"}
    finally:
        engine.dispose()


def test_upgrade_head_matches_models_then_downgrade_base(db_url: str) -> None:
    head = ScriptDirectory.from_config(alembic_config(db_url)).get_current_head()
    assert current_revision(db_url) is None
    upgrade(db_url)
    assert current_revision(db_url) == head
    assert _tables(db_url) == TABLES
    engine = make_engine(db_url)
    try:
        with engine.connect() as conn:
            context = MigrationContext.configure(conn, opts={"compare_type": True})
            diff = compare_metadata(context, metadata)
    finally:
        engine.dispose()
    assert diff == [], f"migrations and registry/models.py disagree: {diff}"

    downgrade(db_url)
    assert current_revision(db_url) is None
    assert _tables(db_url) == set()
    upgrade(db_url)  # and up again: downgrade really removed everything it created
    assert _tables(db_url) == TABLES


def test_revision_files_are_dated_and_descriptive() -> None:
    versions = Path(migrations.__file__).parent / "versions"
    files = sorted(p.name for p in versions.glob("*.py") if p.name != "__init__.py")
    assert files, "no revision files"
    for name in files:
        assert re.fullmatch(r"20\d\d_\d\d_\d\d_\d{4}_[a-z0-9_]+\.py", name), name
