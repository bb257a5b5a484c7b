"""usage_records.user: the OpenAI `user` a request sent, kept with its usage record.

Nullable with no default, so every existing row stays valid (NULL = the request sent no `user`).
SQLite adds the column in place (ALTER TABLE ... ADD COLUMN); dropping it goes through a batch copy.

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-01
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("usage_records", sa.Column("user", sa.String(256), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("usage_records") as batch:
        batch.drop_column("user")
