"""usage_records: the request id is unique per tenant, not globally (issue 29 item 4).

A client may name its request with `X-Request-Id` (api/inference/client_id.py); that id is unique only
within its tenant, so two tenants may both bill `chatcmpl-job-1`. The unique key becomes
(tenant_id, request_id), which `write_usage`'s ON CONFLICT names, and request_id widens to 160
characters (a prefix such as `chatcmpl-` plus up to 128 client characters).

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-03
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0009"
down_revision: str | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("usage_records") as batch:
        batch.drop_constraint("uq_usage_records_request_id", type_="unique")
        batch.alter_column("request_id", type_=sa.String(160), existing_nullable=False)
        batch.create_unique_constraint("uq_usage_records_tenant_id_request_id", ["tenant_id", "request_id"])


def downgrade() -> None:
    """Fails when two tenants hold the same request id (the old key cannot hold both)."""
    with op.batch_alter_table("usage_records") as batch:
        batch.drop_constraint("uq_usage_records_tenant_id_request_id", type_="unique")
        batch.alter_column("request_id", type_=sa.String(128), existing_nullable=False)
        batch.create_unique_constraint("uq_usage_records_request_id", ["request_id"])
