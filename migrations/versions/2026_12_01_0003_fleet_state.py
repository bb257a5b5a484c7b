"""Fleet-wide state: quota counters, console sessions, commit-ordered usage export.

New tables `quota_buckets`, `quota_leases`, `console_sessions` (registry/fleet_state_models.py) and
`usage_records.txid` with an index on (txid, id): the export's order on PostgreSQL (registry/usage.py).
Rows written before this revision get txid 0 there, so they come first, in id order, as before; SQLite
leaves txid NULL (its one writer commits in id order).

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-01
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "quota_buckets",
        sa.Column("tenant_id", sa.String(32), nullable=False),
        sa.Column("requests_capacity", sa.Float(), nullable=True),
        sa.Column("requests_level", sa.Float(), nullable=True),
        sa.Column("tokens_capacity", sa.Float(), nullable=True),
        sa.Column("tokens_level", sa.Float(), nullable=True),
        sa.Column("updated_at", sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint("tenant_id", name=op.f("pk_quota_buckets")),
    )
    op.create_table(
        "quota_leases",
        sa.Column("lease_id", sa.String(64), nullable=False),
        sa.Column("tenant_id", sa.String(32), nullable=False),
        sa.Column("holder", sa.String(128), nullable=False),
        sa.Column("estimated_tokens", sa.Integer(), nullable=False),
        sa.Column("expires_at", sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint("lease_id", name=op.f("pk_quota_leases")),
    )
    op.create_index("ix_quota_leases_tenant_id_expires_at", "quota_leases", ["tenant_id", "expires_at"])
    op.create_index(op.f("ix_quota_leases_holder"), "quota_leases", ["holder"])
    op.create_table(
        "console_sessions",
        sa.Column("id_hash", sa.String(64), nullable=False),
        sa.Column("csrf_token", sa.String(64), nullable=False),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.Column("last_seen", sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint("id_hash", name=op.f("pk_console_sessions")),
    )
    op.create_index(op.f("ix_console_sessions_created_at"), "console_sessions", ["created_at"])
    op.add_column("usage_records", sa.Column("txid", sa.BigInteger(), nullable=True))
    if op.get_bind().dialect.name == "postgresql":
        op.execute("UPDATE usage_records SET txid = 0")
    op.create_index("ix_usage_records_txid_id", "usage_records", ["txid", "id"])


def downgrade() -> None:
    op.drop_index("ix_usage_records_txid_id", table_name="usage_records")
    with op.batch_alter_table("usage_records") as batch:
        batch.drop_column("txid")
    op.drop_index(op.f("ix_console_sessions_created_at"), table_name="console_sessions")
    op.drop_table("console_sessions")
    op.drop_index(op.f("ix_quota_leases_holder"), table_name="quota_leases")
    op.drop_index("ix_quota_leases_tenant_id_expires_at", table_name="quota_leases")
    op.drop_table("quota_leases")
    op.drop_table("quota_buckets")
