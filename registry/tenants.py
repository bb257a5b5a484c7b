"""Tenant service functions: create (with a first API key), look up, list, status and quotas.

Every function is one transaction (`registry.db.transactional`). Names follow `NAME_PATTERN` and are
unique across tenants (a deleted tenant keeps its name).
"""

from __future__ import annotations

import re
import uuid
from dataclasses import asdict

from sqlalchemy import select, update
from sqlalchemy.exc import IntegrityError as SAIntegrityError
from sqlalchemy.orm import Session

from registry.db import transactional
from registry.errors import Conflict, InvalidName, NotFound
from registry.keys import issue_key
from registry.models import AdapterStatus, AdapterVersion, ApiKey, Tenant, TenantStatus, utcnow
from registry.types import PRIORITY_MAX, PRIORITY_MIN, TenantInfo, TenantQuotas

# Safe in URLs, object keys and "name@version" model ids: no '/', '@', whitespace or leading dot.
NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


def check_name(kind: str, name: str) -> str:
    """Return `name` or raise InvalidName saying what is allowed."""
    if not isinstance(name, str) or not NAME_PATTERN.fullmatch(name):
        raise InvalidName(
            f"{kind} name {name!r} is invalid: expected 1-64 characters from A-Z a-z 0-9 . _ -, "
            "starting with a letter or digit"
        )
    return name


@transactional
def create_tenant(
    session: Session, *, name: str, quotas: TenantQuotas | None = None, key_label: str | None = None
) -> tuple[TenantInfo, str]:
    """Create an active tenant and its first API key; the key is returned once and never stored."""
    check_name("tenant", name)
    tenant = Tenant(
        id=uuid.uuid4().hex, name=name, status=TenantStatus.ACTIVE.value, **asdict(quotas or TenantQuotas())
    )
    try:
        with session.begin_nested():
            session.add(tenant)
    except SAIntegrityError as e:
        raise Conflict(f"tenant name {name!r} is already taken") from e
    # Same transaction as the tenant row: both or neither.
    _, api_key = issue_key(session, tenant_id=tenant.id, label=key_label)
    return TenantInfo.from_row(tenant), api_key


def _tenant_row(session: Session, tenant_id: str) -> Tenant:
    row = session.get(Tenant, tenant_id)
    if row is None:
        raise NotFound("tenant", tenant_id)
    return row


@transactional
def get_tenant(session: Session, *, tenant_id: str) -> TenantInfo:
    return TenantInfo.from_row(_tenant_row(session, tenant_id))


@transactional
def get_tenant_by_name(session: Session, *, name: str) -> TenantInfo:
    row = session.scalars(select(Tenant).where(Tenant.name == name)).one_or_none()
    if row is None:
        raise NotFound("tenant", name)
    return TenantInfo.from_row(row)


@transactional
def list_tenants(session: Session, *, include_deleted: bool = False) -> list[TenantInfo]:
    query = select(Tenant).order_by(Tenant.created_at, Tenant.name)
    if not include_deleted:
        query = query.where(Tenant.status != TenantStatus.DELETED.value)
    return [TenantInfo.from_row(row) for row in session.scalars(query)]


@transactional
def set_tenant_status(session: Session, *, tenant_id: str, status: str | TenantStatus) -> TenantInfo:
    """Suspend, reactivate or delete a tenant. Keys and adapters stop working at once (they are
    checked against the tenant's status on every use); deletion is final: it also revokes every key
    and soft-deletes every adapter version. Usage records are kept."""
    try:
        new = TenantStatus(status)
    except ValueError as e:
        raise ValueError(
            f"tenant status must be one of {[s.value for s in TenantStatus]}, got {status!r}"
        ) from e
    row = _tenant_row(session, tenant_id)
    if row.status == TenantStatus.DELETED.value and new != TenantStatus.DELETED:
        raise Conflict(f"tenant {row.name!r} is deleted and cannot become {new.value}")
    row.status = new.value
    if new == TenantStatus.DELETED:
        now = utcnow()
        session.execute(
            update(ApiKey)
            .where(ApiKey.tenant_id == tenant_id, ApiKey.revoked_at.is_(None))
            .values(revoked_at=now)
        )
        session.execute(
            update(AdapterVersion)
            .where(
                AdapterVersion.tenant_id == tenant_id, AdapterVersion.status != AdapterStatus.DELETED.value
            )
            .values(status=AdapterStatus.DELETED.value, deleted_at=now)
        )
    return TenantInfo.from_row(row)


@transactional
def set_tenant_quotas(session: Session, *, tenant_id: str, quotas: TenantQuotas) -> TenantInfo:
    """Replace all five quota columns (None = server default)."""
    row = _tenant_row(session, tenant_id)
    for name, value in asdict(quotas).items():
        setattr(row, name, value)
    return TenantInfo.from_row(row)


@transactional
def set_tenant_priority(session: Session, *, tenant_id: str, default_priority: int) -> TenantInfo:
    """The tenant's default priority (lower = more urgent): what its requests get when they name none,
    and the most urgent level they may ask for."""
    if not PRIORITY_MIN <= default_priority <= PRIORITY_MAX:
        raise ValueError(
            f"default_priority must be in [{PRIORITY_MIN}, {PRIORITY_MAX}], got {default_priority}"
        )
    row = _tenant_row(session, tenant_id)
    row.default_priority = default_priority
    return TenantInfo.from_row(row)
