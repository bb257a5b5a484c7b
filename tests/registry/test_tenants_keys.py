"""Tenants, API keys and the audit log on SQLite and PostgreSQL."""

from __future__ import annotations

import hashlib

import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session

from registry.audit import list_audit, record_audit
from registry.errors import AuthError, Conflict, InvalidName, NotFound
from registry.keys import authenticate, issue_key, key_prefix, list_keys, revoke_key
from registry.models import ApiKey
from registry.tenants import (
    create_tenant,
    get_tenant,
    get_tenant_by_name,
    list_tenants,
    set_tenant_quotas,
    set_tenant_status,
)
from registry.types import TenantQuotas


def test_create_tenant_key_authenticates(session: Session) -> None:
    tenant, api_key = create_tenant(session, name="acme")
    assert tenant.status == "active" and tenant.created_at.tzinfo is not None
    assert authenticate(session, api_key=api_key) == tenant
    assert get_tenant(session, tenant_id=tenant.id) == tenant
    assert get_tenant_by_name(session, name="acme") == tenant
    assert [k.prefix for k in list_keys(session, tenant_id=tenant.id)] == [key_prefix(api_key)]


def test_only_prefix_and_salted_hash_are_stored(session: Session) -> None:
    tenant, api_key = create_tenant(session, name="acme")
    row = session.scalars(select(ApiKey).where(ApiKey.tenant_id == tenant.id)).one()
    stored = " ".join(str(v) for v in (row.prefix, row.salt, row.key_hash, row.label))
    secret = api_key.split("-", 2)[2]
    assert secret not in stored and api_key not in stored
    assert row.key_hash != hashlib.sha256(api_key.encode()).hexdigest()  # salted
    assert row.key_hash == hashlib.sha256(bytes.fromhex(row.salt) + api_key.encode()).hexdigest()


def test_tenant_names_unique_and_checked(session: Session) -> None:
    create_tenant(session, name="acme")
    with pytest.raises(Conflict, match="'acme' is already taken"):
        create_tenant(session, name="acme")
    for bad in ("a/b", "", "x" * 65, "-lead", "has space", "a@b"):
        with pytest.raises(InvalidName, match="tenant name"):
            create_tenant(session, name=bad)
    assert [t.name for t in list_tenants(session)] == ["acme"]  # failures left no rows


@pytest.mark.parametrize(
    "mangle",
    [
        lambda k: k[:-1] + ("A" if k[-1] != "A" else "B"),  # wrong secret, right prefix
        lambda k: "lsk-000000000000-" + k.split("-", 2)[2],  # unknown prefix
        lambda k: k.replace("lsk-", "sk-"),  # malformed
        lambda k: "",
    ],
    ids=["wrong-secret", "unknown-prefix", "malformed", "empty"],
)
def test_bad_keys_refused(session: Session, mangle) -> None:  # type: ignore[no-untyped-def]
    _, api_key = create_tenant(session, name="acme")
    bad = mangle(api_key)
    with pytest.raises(AuthError) as info:
        authenticate(session, api_key=bad)
    assert not bad or bad.split("-", 2)[-1] not in str(info.value)  # never echo the secret


def test_revoked_key_refused_other_key_works(session: Session) -> None:
    tenant, first = create_tenant(session, name="acme")
    info, second = issue_key(session, tenant_id=tenant.id, label="ci")
    assert info.label == "ci" and info.revoked_at is None
    revoked = revoke_key(session, tenant_id=tenant.id, prefix=key_prefix(first))
    assert revoked.revoked_at is not None
    with pytest.raises(AuthError, match="revoked"):
        authenticate(session, api_key=first)
    assert authenticate(session, api_key=second).id == tenant.id
    assert revoke_key(session, tenant_id=tenant.id, prefix=key_prefix(first)) == revoked  # idempotent


def test_cannot_revoke_another_tenants_key(session: Session) -> None:
    a, key_a = create_tenant(session, name="a")
    b, _ = create_tenant(session, name="b")
    with pytest.raises(NotFound) as theirs:
        revoke_key(session, tenant_id=b.id, prefix=key_prefix(key_a))
    with pytest.raises(NotFound) as unknown:
        revoke_key(session, tenant_id=b.id, prefix="ffffffffffff")
    assert str(theirs.value).replace(key_prefix(key_a), "X") == str(unknown.value).replace(
        "ffffffffffff", "X"
    )
    assert authenticate(session, api_key=key_a).id == a.id


def test_suspend_and_reactivate(session: Session) -> None:
    tenant, api_key = create_tenant(session, name="acme")
    set_tenant_status(session, tenant_id=tenant.id, status="suspended")
    with pytest.raises(AuthError, match="'acme' is suspended"):
        authenticate(session, api_key=api_key)
    set_tenant_status(session, tenant_id=tenant.id, status="active")
    assert authenticate(session, api_key=api_key).status == "active"
    with pytest.raises(ValueError, match="must be one of"):
        set_tenant_status(session, tenant_id=tenant.id, status="paused")


def test_delete_is_final_and_revokes_keys(session: Session) -> None:
    tenant, api_key = create_tenant(session, name="acme")
    set_tenant_status(session, tenant_id=tenant.id, status="deleted")
    with pytest.raises(AuthError):
        authenticate(session, api_key=api_key)
    assert all(k.revoked_at is not None for k in list_keys(session, tenant_id=tenant.id))
    with pytest.raises(Conflict, match="deleted"):
        set_tenant_status(session, tenant_id=tenant.id, status="active")
    with pytest.raises(Conflict, match="deleted"):
        issue_key(session, tenant_id=tenant.id)
    assert list_tenants(session) == []
    assert [t.id for t in list_tenants(session, include_deleted=True)] == [tenant.id]


def test_quotas_round_trip(session: Session) -> None:
    tenant, _ = create_tenant(session, name="acme", quotas=TenantQuotas(rpm=60))
    assert tenant.quotas == TenantQuotas(rpm=60)
    quotas = TenantQuotas(rpm=10, tpm=1000, max_concurrent=2, max_adapters=3, max_adapter_bytes=5 << 30)
    assert set_tenant_quotas(session, tenant_id=tenant.id, quotas=quotas).quotas == quotas
    assert get_tenant(session, tenant_id=tenant.id).quotas == quotas
    with pytest.raises(ValueError, match="rpm"):
        TenantQuotas(rpm=-1)


def test_audit_log(session: Session) -> None:
    tenant, api_key = create_tenant(session, name="acme")
    record_audit(session, actor="admin", action="tenant.create", tenant_id=tenant.id, target="acme")
    record_audit(
        session,
        actor=f"key:{key_prefix(api_key)}",
        action="adapter.delete",
        tenant_id=tenant.id,
        target="bot@1",
        detail={"versions": [1]},
    )
    record_audit(session, actor="admin", action="tenant.create", target="other")
    entries = list_audit(session, tenant_id=tenant.id)
    assert [e.action for e in entries] == ["adapter.delete", "tenant.create"]  # newest first
    assert entries[0].detail == {"versions": [1]}
    assert [e.target for e in list_audit(session, limit=1)] == ["other"]
    assert len(list_audit(session, before_id=entries[0].id)) == 1
