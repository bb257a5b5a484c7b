"""Fleet membership: replica heartbeats and residency, operator pins, fleet events.

Three new tables, nothing existing changes: `fleet_replicas` (one row per live replica, rewritten by
its heartbeat), `fleet_pins` (operator pins as state, so a replica started later applies them) and
`fleet_events` (append-only admin actions every replica polls). See registry/fleet_models.py.

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-01
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def _ts(name: str, nullable: bool = False) -> sa.Column:
    return sa.Column(name, sa.DateTime(timezone=True), nullable=nullable)


def upgrade() -> None:
    op.create_table(
        "fleet_replicas",
        sa.Column("replica_id", sa.String(128), nullable=False),
        sa.Column("host", sa.String(255), nullable=False),
        sa.Column("pid", sa.Integer(), nullable=False),
        _ts("started_at"),
        _ts("last_seen"),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("stats", sa.JSON(), nullable=False),
        sa.Column("residency", sa.JSON(), nullable=False),
        sa.Column("metrics", sa.Text(), nullable=True),
        _ts("metrics_at", nullable=True),
        sa.PrimaryKeyConstraint("replica_id", name="pk_fleet_replicas"),
        sa.CheckConstraint(
            "state IN ('starting', 'ready', 'unhealthy', 'draining')", name="ck_fleet_replicas_state"
        ),
    )
    op.create_index("ix_fleet_replicas_last_seen", "fleet_replicas", ["last_seen"])
    op.create_table(
        "fleet_pins",
        sa.Column("tenant_id", sa.String(32), nullable=False),
        sa.Column("name", sa.String(64), nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        _ts("pinned_at"),
        sa.PrimaryKeyConstraint("tenant_id", "name", "version", name="pk_fleet_pins"),
        sa.ForeignKeyConstraint(["tenant_id"], ["tenants.id"], name="fk_fleet_pins_tenant_id_tenants"),
    )
    op.create_table(
        "fleet_events",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("kind", sa.String(32), nullable=False),
        sa.Column("tenant_id", sa.String(32), nullable=True),
        sa.Column("payload", sa.JSON(), nullable=False),
        _ts("created_at"),
        sa.PrimaryKeyConstraint("id", name="pk_fleet_events"),
        sa.CheckConstraint(
            "kind IN ('pin', 'unpin', 'adapter_delete', 'tenant_suspend', 'tenant_activate', "
            "'tenant_delete')",
            name="ck_fleet_events_kind",
        ),
    )
    op.create_index("ix_fleet_events_created_at", "fleet_events", ["created_at"])


def downgrade() -> None:
    op.drop_index("ix_fleet_events_created_at", table_name="fleet_events")
    op.drop_table("fleet_events")
    op.drop_table("fleet_pins")
    op.drop_index("ix_fleet_replicas_last_seen", table_name="fleet_replicas")
    op.drop_table("fleet_replicas")
