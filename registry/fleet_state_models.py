"""Fleet-wide state: quota counters, console sessions, usage export ordering.

A fleet of `loraserve serve --fleet` replicas shares one PostgreSQL database, so what one process
kept in memory lives here instead: each tenant's rate-limit buckets (one row, locked for the short
transaction of an admission), its concurrency leases (one row per running request, with an expiry
that the holding replica renews, so a replica killed with -9 frees its slots within one lease
period), and the admin console's sessions (only the sha256 of the cookie's id is stored).

Times are epoch seconds as doubles (`Float`): the quota arithmetic is in seconds, and on PostgreSQL
they come from the database's own clock, so replicas whose clocks differ still agree.
"""

from __future__ import annotations

from sqlalchemy import Float, Index, Integer, String
from sqlalchemy.orm import Mapped, mapped_column

from registry.models import Base


class QuotaBucketRow(Base):
    """A tenant's two token buckets (api/tenancy/quotas.py): NULL capacity = no bucket (unlimited)."""

    __tablename__ = "quota_buckets"

    tenant_id: Mapped[str] = mapped_column(String(32), primary_key=True)
    requests_capacity: Mapped[float | None] = mapped_column(Float)
    requests_level: Mapped[float | None] = mapped_column(Float)
    tokens_capacity: Mapped[float | None] = mapped_column(Float)
    tokens_level: Mapped[float | None] = mapped_column(Float)
    updated_at: Mapped[float] = mapped_column(Float)  # epoch seconds of the last refill


class QuotaLeaseRow(Base):
    """One admitted request holding a concurrency slot until released or `expires_at` passes."""

    __tablename__ = "quota_leases"
    __table_args__ = (Index("ix_quota_leases_tenant_id_expires_at", "tenant_id", "expires_at"),)

    lease_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(String(32))
    holder: Mapped[str] = mapped_column(String(128), index=True)  # "<replica id>/<process incarnation>"
    estimated_tokens: Mapped[int] = mapped_column(Integer)
    expires_at: Mapped[float] = mapped_column(Float)


class ConsoleSessionRow(Base):
    """An admin console login; the cookie carries the id, the table only its sha256."""

    __tablename__ = "console_sessions"

    id_hash: Mapped[str] = mapped_column(String(64), primary_key=True)  # hex sha256 of the cookie's id
    csrf_token: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[float] = mapped_column(Float, index=True)  # epoch seconds
    last_seen: Mapped[float] = mapped_column(Float)
