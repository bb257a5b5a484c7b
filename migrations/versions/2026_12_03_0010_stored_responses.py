"""Stored responses (the Responses API's `store: true`): `stored_responses`, one row per kept response,
keyed by (tenant, response id), expiring after the server's retention. One new table, nothing
existing changes. See registry/response_models.py.

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-03
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0010"
down_revision: str | None = "0009"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "stored_responses",
        sa.Column("tenant_id", sa.String(32), nullable=False),
        sa.Column("response_id", sa.String(200), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("input_items", sa.JSON(), nullable=False),
        sa.Column("response", sa.JSON(), nullable=False),
        sa.PrimaryKeyConstraint("tenant_id", "response_id", name="pk_stored_responses"),
        sa.ForeignKeyConstraint(["tenant_id"], ["tenants.id"], name="fk_stored_responses_tenant_id_tenants"),
    )
    op.create_index("ix_stored_responses_expires_at", "stored_responses", ["expires_at"])


def downgrade() -> None:
    op.drop_index("ix_stored_responses_expires_at", table_name="stored_responses")
    op.drop_table("stored_responses")
