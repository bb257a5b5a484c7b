"""Adapters by reference, per tenant: `import_grants` (the prefixes the admin allows each tenant to import
from) and `import_claims` (which tenant imported from a source first; no other tenant reads it again).
Two new tables, nothing existing changes. See registry/import_models.py.

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-02
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "import_grants",
        sa.Column("tenant_id", sa.String(32), nullable=False),
        sa.Column("prefix_sha256", sa.String(64), nullable=False),
        sa.Column("prefix", sa.String(2048), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("tenant_id", "prefix_sha256", name="pk_import_grants"),
        sa.ForeignKeyConstraint(["tenant_id"], ["tenants.id"], name="fk_import_grants_tenant_id_tenants"),
    )
    op.create_table(
        "import_claims",
        sa.Column("source_sha256", sa.String(64), nullable=False),
        sa.Column("source_uri", sa.String(2048), nullable=False),
        sa.Column("tenant_id", sa.String(32), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("source_sha256", name="pk_import_claims"),
        sa.ForeignKeyConstraint(["tenant_id"], ["tenants.id"], name="fk_import_claims_tenant_id_tenants"),
    )
    op.create_index("ix_import_claims_tenant_id", "import_claims", ["tenant_id"])


def downgrade() -> None:
    op.drop_index("ix_import_claims_tenant_id", table_name="import_claims")
    op.drop_table("import_claims")
    op.drop_table("import_grants")
