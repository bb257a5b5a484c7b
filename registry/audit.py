"""Audit log of management actions (tenant, key and adapter changes), append-only."""

from __future__ import annotations

from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from registry.db import transactional
from registry.models import AuditEntry
from registry.types import AuditInfo


@transactional
def record_audit(
    session: Session,
    *,
    actor: str,
    action: str,
    tenant_id: str | None = None,
    target: str | None = None,
    detail: dict[str, Any] | None = None,
) -> AuditInfo:
    """Append one entry: `actor` ("admin", "key:<prefix>") did `action` ("adapter.delete") to
    `target` ("support-bot@2") of `tenant_id`. Never put secrets in `detail`."""
    if not actor or not action:
        raise ValueError(f"audit entries need an actor and an action, got actor={actor!r} action={action!r}")
    row = AuditEntry(actor=actor, action=action, tenant_id=tenant_id, target=target, detail=detail)
    session.add(row)
    session.flush()
    return AuditInfo.from_row(row)


@transactional
def list_audit(
    session: Session, *, tenant_id: str | None = None, limit: int = 100, before_id: int | None = None
) -> list[AuditInfo]:
    """Newest first; page with `before_id` = the last id seen."""
    if limit < 1:
        raise ValueError(f"limit must be >= 1, got {limit}")
    query = select(AuditEntry).order_by(AuditEntry.id.desc()).limit(limit)
    if tenant_id is not None:
        query = query.where(AuditEntry.tenant_id == tenant_id)
    if before_id is not None:
        query = query.where(AuditEntry.id < before_id)
    return [AuditInfo.from_row(row) for row in session.scalars(query)]
