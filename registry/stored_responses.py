"""Stored responses per tenant (table in registry/response_models.py): keep, read, delete, purge.

A response of another tenant, one never stored and one deleted are the same `NotFound`; one past its
`expires_at` but not yet purged is `Expired` (the caller names the retention). `save_response` also
purges every tenant's expired rows (an indexed range delete), so the table holds at most one
retention's worth; `purge_expired_responses` does only that.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import delete
from sqlalchemy.orm import Session

from registry.db import transactional
from registry.errors import NotFound, RegistryError
from registry.response_models import StoredResponseRow


class Expired(RegistryError):
    """A stored response past its retention (not yet purged)."""

    def __init__(self, response_id: str, expires_at: datetime) -> None:
        super().__init__(f"response {response_id!r} expired at {expires_at.isoformat()}")
        self.response_id = response_id
        self.expires_at = expires_at


@dataclass(frozen=True, slots=True)
class StoredResponse:
    response_id: str
    tenant_id: str
    created_at: datetime
    expires_at: datetime
    input_items: list[Any]  # the whole conversation it answered, as Responses input items
    response: dict[str, Any]  # the response object as returned


def _now(now: datetime | None) -> datetime:
    return now if now is not None else datetime.now(UTC)


@transactional
def save_response(
    session: Session,
    *,
    tenant_id: str,
    response_id: str,
    input_items: list[Any],
    response: dict[str, Any],
    retention_s: float,
    now: datetime | None = None,
) -> None:
    """Keep a response for `retention_s`; saving an id the tenant already has keeps the first (a
    fleet retry of the same request)."""
    now = _now(now)
    session.execute(delete(StoredResponseRow).where(StoredResponseRow.expires_at <= now))
    if session.get(StoredResponseRow, (tenant_id, response_id)) is not None:
        return
    session.add(
        StoredResponseRow(
            tenant_id=tenant_id,
            response_id=response_id,
            created_at=now,
            expires_at=now + timedelta(seconds=retention_s),
            input_items=input_items,
            response=response,
        )  # fmt: skip
    )


@transactional
def get_response(
    session: Session, *, tenant_id: str, response_id: str, now: datetime | None = None
) -> StoredResponse:
    row = session.get(StoredResponseRow, (tenant_id, response_id))
    if row is None:
        raise NotFound("response", response_id)
    if row.expires_at <= _now(now):
        raise Expired(response_id, row.expires_at)
    items, response = list(row.input_items), dict(row.response)
    return StoredResponse(row.response_id, row.tenant_id, row.created_at, row.expires_at, items, response)


@transactional
def delete_response(session: Session, *, tenant_id: str, response_id: str) -> None:
    row = session.get(StoredResponseRow, (tenant_id, response_id))
    if row is None:
        raise NotFound("response", response_id)
    session.delete(row)


@transactional
def purge_expired_responses(session: Session, *, now: datetime | None = None) -> int:
    """Deletes every tenant's responses past their retention; returns how many."""
    result = session.execute(delete(StoredResponseRow).where(StoredResponseRow.expires_at <= _now(now)))
    return int(result.rowcount or 0)  # type: ignore[attr-defined]
