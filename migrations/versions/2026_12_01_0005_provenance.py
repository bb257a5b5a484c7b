"""usage_records.provenance: what produced each answer, kept with its usage record.

One JSON object per row (registry/provenance.py: build, base and adapter hashes, dtype, device, kernels,
seed, the invariance flag), nullable with no default: rows billed before this revision stay valid (NULL =
written by an older server). SQLite adds the column in place; dropping it goes through a batch copy.

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-01
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("usage_records", sa.Column("provenance", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("usage_records") as batch:
        batch.drop_column("provenance")
