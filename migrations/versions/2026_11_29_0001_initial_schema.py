"""Initial schema: tenants, api_keys, adapter_versions, usage_records, audit_log.

Revision ID: 0001
Revises:
Create Date: 2026-11-29
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def _ts(name: str, nullable: bool = False) -> sa.Column:
    return sa.Column(name, sa.DateTime(timezone=True), nullable=nullable)


def upgrade() -> None:
    op.create_table(
        "tenants",
        sa.Column("id", sa.String(32), nullable=False),
        sa.Column("name", sa.String(64), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        _ts("created_at"),
        sa.Column("rpm", sa.Integer(), nullable=True),
        sa.Column("tpm", sa.Integer(), nullable=True),
        sa.Column("max_concurrent", sa.Integer(), nullable=True),
        sa.Column("max_adapters", sa.Integer(), nullable=True),
        sa.Column("max_adapter_bytes", sa.BigInteger(), nullable=True),
        sa.PrimaryKeyConstraint("id", name="pk_tenants"),
        sa.UniqueConstraint("name", name="uq_tenants_name"),
        sa.CheckConstraint("status IN ('active', 'suspended', 'deleted')", name="ck_tenants_status"),
    )
    op.create_table(
        "api_keys",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("tenant_id", sa.String(32), nullable=False),
        sa.Column("prefix", sa.String(16), nullable=False),
        sa.Column("salt", sa.String(32), nullable=False),
        sa.Column("key_hash", sa.String(64), nullable=False),
        sa.Column("label", sa.String(64), nullable=True),
        _ts("created_at"),
        _ts("revoked_at", nullable=True),
        sa.PrimaryKeyConstraint("id", name="pk_api_keys"),
        sa.ForeignKeyConstraint(["tenant_id"], ["tenants.id"], name="fk_api_keys_tenant_id_tenants"),
        sa.UniqueConstraint("prefix", name="uq_api_keys_prefix"),
    )
    op.create_index("ix_api_keys_tenant_id", "api_keys", ["tenant_id"])
    op.create_table(
        "adapter_versions",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("tenant_id", sa.String(32), nullable=False),
        sa.Column("name", sa.String(64), nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("base_model", sa.String(256), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("sha256", sa.String(64), nullable=False),
        sa.Column("config_sha256", sa.String(64), nullable=False),
        sa.Column("size_bytes", sa.BigInteger(), nullable=False),
        sa.Column("max_rank", sa.Integer(), nullable=False),
        sa.Column("ranks", sa.JSON(), nullable=False),
        sa.Column("modules", sa.JSON(), nullable=False),
        _ts("created_at"),
        _ts("deleted_at", nullable=True),
        sa.PrimaryKeyConstraint("id", name="pk_adapter_versions"),
        sa.ForeignKeyConstraint(["tenant_id"], ["tenants.id"], name="fk_adapter_versions_tenant_id_tenants"),
        sa.UniqueConstraint(
            "tenant_id", "name", "version", name="uq_adapter_versions_tenant_id_name_version"
        ),
        sa.CheckConstraint("status IN ('ready', 'deleted')", name="ck_adapter_versions_status"),
        sa.CheckConstraint("version >= 1", name="ck_adapter_versions_version_positive"),
    )
    op.create_index("ix_adapter_versions_tenant_id", "adapter_versions", ["tenant_id"])
    op.create_index("ix_adapter_versions_sha256", "adapter_versions", ["sha256"])
    op.create_table(
        "usage_records",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=False),
        sa.Column("request_id", sa.String(128), nullable=False),
        sa.Column("tenant_id", sa.String(32), nullable=False),
        sa.Column("key_prefix", sa.String(16), nullable=True),
        sa.Column("adapter_name", sa.String(64), nullable=True),
        sa.Column("adapter_version", sa.Integer(), nullable=True),
        sa.Column("prompt_tokens", sa.Integer(), nullable=False),
        sa.Column("cached_prompt_tokens", sa.Integer(), nullable=False),
        sa.Column("completion_tokens", sa.Integer(), nullable=False),
        sa.Column("finish_reason", sa.String(32), nullable=False),
        sa.Column("queue_time_s", sa.Float(), nullable=False),
        sa.Column("ttft_s", sa.Float(), nullable=True),
        sa.Column("total_time_s", sa.Float(), nullable=False),
        _ts("created_at"),
        _ts("finished_at"),
        sa.PrimaryKeyConstraint("id", name="pk_usage_records"),
        sa.UniqueConstraint("request_id", name="uq_usage_records_request_id"),
    )
    op.create_index("ix_usage_records_finished_at", "usage_records", ["finished_at"])
    op.create_index("ix_usage_records_tenant_id_finished_at", "usage_records", ["tenant_id", "finished_at"])
    op.create_table(
        "audit_log",
        sa.Column("id", sa.Integer(), nullable=False),
        _ts("created_at"),
        sa.Column("actor", sa.String(64), nullable=False),
        sa.Column("action", sa.String(64), nullable=False),
        sa.Column("tenant_id", sa.String(32), nullable=True),
        sa.Column("target", sa.String(256), nullable=True),
        sa.Column("detail", sa.JSON(), nullable=True),
        sa.PrimaryKeyConstraint("id", name="pk_audit_log"),
    )
    op.create_index("ix_audit_log_created_at", "audit_log", ["created_at"])
    op.create_index("ix_audit_log_tenant_id", "audit_log", ["tenant_id"])


def downgrade() -> None:
    op.drop_table("audit_log")
    op.drop_table("usage_records")
    op.drop_table("adapter_versions")
    op.drop_table("api_keys")
    op.drop_table("tenants")
