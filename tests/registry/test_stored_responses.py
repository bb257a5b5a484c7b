"""Stored responses in the registry, on SQLite and PostgreSQL (migration 0010): kept per tenant (another
tenant's id is NotFound), past the retention Expired until purged, a save purges every tenant's expired
rows, a second save of one id keeps the first, delete removes."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy.orm import Session

from registry.errors import NotFound
from registry.stored_responses import (
    Expired,
    delete_response,
    get_response,
    purge_expired_responses,
    save_response,
)
from registry.tenants import create_tenant

T0 = datetime(2026, 12, 3, 12, 0, tzinfo=UTC)
ITEMS = [{"type": "message", "role": "user", "content": "hi"}]


def _save(session: Session, tenant_id: str, rid: str, *, now: datetime = T0, text: str = "a") -> None:
    response = {"id": rid, "object": "response", "output": [{"type": "message", "content": text}]}
    save_response(
        session, tenant_id=tenant_id, response_id=rid, input_items=ITEMS, response=response,
        retention_s=60, now=now,
    )  # fmt: skip


def _text(session: Session, tenant_id: str, rid: str) -> str:
    got = get_response(session, tenant_id=tenant_id, response_id=rid, now=T0)
    return got.response["output"][0]["content"]


def test_kept_per_tenant_expired_then_purged(session: Session) -> None:
    (a, _), (b, _) = create_tenant(session, name="sr-a"), create_tenant(session, name="sr-b")
    _save(session, a.id, "resp_1")
    got = get_response(session, tenant_id=a.id, response_id="resp_1", now=T0 + timedelta(seconds=59))
    assert got.input_items == ITEMS and got.response["output"][0]["content"] == "a"
    assert got.expires_at == T0 + timedelta(seconds=60)
    with pytest.raises(NotFound):
        get_response(session, tenant_id=b.id, response_id="resp_1", now=T0)  # never another tenant's
    _save(session, b.id, "resp_1", text="b")  # the same id in another tenant: its own row
    assert _text(session, b.id, "resp_1") == "b"
    _save(session, a.id, "resp_1", text="again")  # a retry of the same request: the first kept
    assert _text(session, a.id, "resp_1") == "a"
    with pytest.raises(Expired):
        get_response(session, tenant_id=a.id, response_id="resp_1", now=T0 + timedelta(seconds=60))
    assert purge_expired_responses(session, now=T0 + timedelta(seconds=61)) == 2
    with pytest.raises(NotFound):
        get_response(session, tenant_id=a.id, response_id="resp_1", now=T0)


def test_a_save_purges_expired_rows_and_delete_removes(session: Session) -> None:
    tenant, _ = create_tenant(session, name="sr-c")
    _save(session, tenant.id, "resp_old")
    _save(session, tenant.id, "resp_new", now=T0 + timedelta(seconds=120))
    with pytest.raises(NotFound):  # purged by the later save, not merely expired
        get_response(session, tenant_id=tenant.id, response_id="resp_old", now=T0)
    delete_response(session, tenant_id=tenant.id, response_id="resp_new")
    with pytest.raises(NotFound):
        delete_response(session, tenant_id=tenant.id, response_id="resp_new")
