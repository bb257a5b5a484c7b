"""adapter_versions.coverage: what each adapter version changes on the served model.

One JSON object per row, computed at upload (adapters/coverage.py): per layer and projection the kind
(lora / dora), rank, scale, ||s B A||_F and its ratio to ||W||_F, the kinds present, and a warning when
the change is negligible everywhere. Nullable with no default: versions registered before this revision
stay valid (NULL = not computed). SQLite adds the column in place; dropping it goes through a batch copy.

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-02
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("adapter_versions", sa.Column("coverage", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("adapter_versions") as batch:
        batch.drop_column("coverage")
