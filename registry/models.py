"""SQLAlchemy 2.0 tables of the registry: tenants, API keys, adapter versions, usage, audit log.

Declarative `Mapped`/`mapped_column` with a naming convention, so Alembic revisions
(migrations/versions/) name every constraint the same way on SQLite and PostgreSQL. Timestamps are
stored in UTC and always come back timezone-aware. `Base` is shared by the fleet's tables
(fleet_models.py, fleet_state_models.py); registry/tables.py gathers every table module into one
metadata.
"""

from __future__ import annotations

import enum
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    CheckConstraint,
    DateTime,
    Dialect,
    Float,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    TypeDecorator,
    UniqueConstraint,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

MAX_USER_CHARS = 256  # OpenAI's `user` field, kept with each usage record

NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


class UTCDateTime(TypeDecorator[datetime]):
    """DateTime that refuses naive values and returns aware UTC on every backend (SQLite drops tz)."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError(f"timestamps must be timezone-aware, got naive {value!r}")
        return value.astimezone(UTC)

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


def utcnow() -> datetime:
    return datetime.now(UTC)


class TenantStatus(enum.StrEnum):
    ACTIVE = "active"
    SUSPENDED = "suspended"
    DELETED = "deleted"


class AdapterStatus(enum.StrEnum):
    # A row is written only after validation and the object uploads succeeded, so it starts ready.
    READY = "ready"
    DELETED = "deleted"


def _in(column: str, enum_cls: type[enum.StrEnum]) -> str:
    return f"{column} IN ({', '.join(repr(m.value) for m in enum_cls)})"


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)
    type_annotation_map = {datetime: UTCDateTime}


class Tenant(Base):
    __tablename__ = "tenants"
    __table_args__ = (CheckConstraint(_in("status", TenantStatus), name="status"),)

    id: Mapped[str] = mapped_column(String(32), primary_key=True)  # opaque uuid4 hex
    name: Mapped[str] = mapped_column(String(64), unique=True)
    status: Mapped[str] = mapped_column(String(16), default=TenantStatus.ACTIVE.value)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    # Quotas: NULL means "use the server default".
    rpm: Mapped[int | None] = mapped_column(Integer)
    tpm: Mapped[int | None] = mapped_column(Integer)
    max_concurrent: Mapped[int | None] = mapped_column(Integer)
    max_adapters: Mapped[int | None] = mapped_column(Integer)
    max_adapter_bytes: Mapped[int | None] = mapped_column(BigInteger)
    # Priority class (lower = more urgent): its requests' default and the most urgent they may ask for.
    default_priority: Mapped[int] = mapped_column(Integer, default=0, server_default="0")


class ApiKey(Base):
    """Only the visible prefix and a salted sha256 of the whole key are kept; the key is shown once."""

    __tablename__ = "api_keys"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id"), index=True)
    prefix: Mapped[str] = mapped_column(String(16), unique=True)
    salt: Mapped[str] = mapped_column(String(32))  # hex
    key_hash: Mapped[str] = mapped_column(String(64))  # hex sha256(salt || key)
    label: Mapped[str | None] = mapped_column(String(64))
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    revoked_at: Mapped[datetime | None] = mapped_column()


class AdapterVersion(Base):
    """One immutable adapter version; (tenant_id, name, version) is unique, names only per tenant."""

    __tablename__ = "adapter_versions"
    __table_args__ = (
        UniqueConstraint("tenant_id", "name", "version"),
        CheckConstraint(_in("status", AdapterStatus), name="status"),
        CheckConstraint("version >= 1", name="version_positive"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id"), index=True)
    name: Mapped[str] = mapped_column(String(64))
    version: Mapped[int] = mapped_column(Integer)
    base_model: Mapped[str] = mapped_column(String(256))
    status: Mapped[str] = mapped_column(String(16), default=AdapterStatus.READY.value)
    sha256: Mapped[str] = mapped_column(String(64), index=True)  # adapter_model.safetensors
    config_sha256: Mapped[str] = mapped_column(String(64))  # adapter_config.json
    size_bytes: Mapped[int] = mapped_column(BigInteger)
    max_rank: Mapped[int] = mapped_column(Integer)
    ranks: Mapped[dict[str, int]] = mapped_column(JSON)  # module name -> rank
    modules: Mapped[list[str]] = mapped_column(JSON)  # target module names, sorted
    coverage: Mapped[dict[str, Any] | None] = mapped_column(JSON)  # CoverageReport.as_json(); NULL: older
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    deleted_at: Mapped[datetime | None] = mapped_column()


class UsageRow(Base):
    """One row per engine request. No foreign key to tenants on purpose: a billing record is never
    refused or cascaded away because of the tenant's later state."""

    __tablename__ = "usage_records"
    __table_args__ = (
        Index("ix_usage_records_tenant_id_finished_at", "tenant_id", "finished_at"),
        Index("ix_usage_records_txid_id", "txid", "id"),
        # a client's X-Request-Id is unique within its tenant only (migration 0009)
        UniqueConstraint("tenant_id", "request_id"),
    )

    # Export cursor order. BIGINT on PostgreSQL; SQLite needs exactly INTEGER for its rowid alias.
    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True)
    request_id: Mapped[str] = mapped_column(String(160))  # prefix + up to 128 client characters
    tenant_id: Mapped[str] = mapped_column(String(32))
    key_prefix: Mapped[str | None] = mapped_column(String(16))
    adapter_name: Mapped[str | None] = mapped_column(String(64))  # NULL = base model
    adapter_version: Mapped[int | None] = mapped_column(Integer)
    prompt_tokens: Mapped[int] = mapped_column(Integer)
    cached_prompt_tokens: Mapped[int] = mapped_column(Integer)
    completion_tokens: Mapped[int] = mapped_column(Integer)
    finish_reason: Mapped[str] = mapped_column(String(32))
    queue_time_s: Mapped[float] = mapped_column(Float)
    ttft_s: Mapped[float | None] = mapped_column(Float)  # NULL when no token was produced
    total_time_s: Mapped[float] = mapped_column(Float)
    created_at: Mapped[datetime] = mapped_column()
    finished_at: Mapped[datetime] = mapped_column(index=True)
    # What produced the answer (registry/provenance.py); NULL = billed by an older server.
    provenance: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    user: Mapped[str | None] = mapped_column(String(MAX_USER_CHARS))  # OpenAI `user`; NULL = not sent
    # PostgreSQL: the writing transaction's id (pg_current_xact_id), the commit-safe export order of
    # registry/usage.py with several writers; NULL on SQLite, whose one writer commits in id order.
    txid: Mapped[int | None] = mapped_column(BigInteger)


class AuditEntry(Base):
    """Management actions (who did what to which tenant/object), append-only."""

    __tablename__ = "audit_log"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    created_at: Mapped[datetime] = mapped_column(default=utcnow, index=True)
    actor: Mapped[str] = mapped_column(String(64))  # "admin" or "key:<prefix>"
    action: Mapped[str] = mapped_column(String(64))  # e.g. "tenant.create", "adapter.delete"
    tenant_id: Mapped[str | None] = mapped_column(String(32), index=True)
    target: Mapped[str | None] = mapped_column(String(256))
    detail: Mapped[dict[str, Any] | None] = mapped_column(JSON)
