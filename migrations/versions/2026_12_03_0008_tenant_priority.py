"""tenants.default_priority: a tenant's priority class (issue 29 item 2).

Lower = more urgent (vLLM's convention). A request that names no `priority` gets it; a request may not
ask for a more urgent level. NOT NULL with a server default of 0, so existing tenants keep the one
level every request had before priority classes.

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-03
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0008"
down_revision: str | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column(
        "tenants", sa.Column("default_priority", sa.Integer(), nullable=False, server_default=sa.text("0"))
    )


def downgrade() -> None:
    with op.batch_alter_table("tenants") as batch:
        batch.drop_column("default_priority")
